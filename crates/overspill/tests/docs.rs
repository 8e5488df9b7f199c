//! The shipped Grafana dashboard's queries are valid PromQL over metric families the server
//! really exports (checked with promtool and against the server's own exposition code).

use std::process::Command;

use serde_json::Value;

#[test]
fn dashboard_queries_parse_and_name_real_families() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("JSON");
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    assert!(exprs.len() >= 8);
    // Several hosts scraped at once: every query keeps to the chosen hosts, and none reduces a
    // vector to one number (scalar() is NaN once there are two series).
    for expr in &exprs {
        assert!(!expr.contains("scalar("), "{expr}");
        assert!(expr.contains(r#"instance=~"$instance""#), "{expr} ignores the host variable");
    }
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(variables.contains(&"instance") && variables.contains(&"export"), "{variables:?}");
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in exprs.iter().enumerate() {
        rules.push_str(&format!("      - record: dashboard:q{i}\n        expr: '{}'\n", expr.replace('\'', "''")));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("rules.yml");
    std::fs::write(&file, rules).expect("write rules");
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("promtool is not installed (apt-get install prometheus): {e}"));
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));

    assert_real_families(&exprs);
}

/// Every overspill_* name in these queries is a family the exposition writes.
fn assert_real_families(exprs: &[String]) {
    let source = include_str!("../src/metrics.rs");
    for expr in exprs {
        for word in expr.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if let Some(name) = word.strip_prefix("overspill_") {
                let base = name.trim_end_matches("_bucket");
                let family = base.strip_prefix("vm_").unwrap_or(base);
                assert!(
                    source.contains(&format!("\"{family}\"")) || source.contains(&format!("overspill_{base}")),
                    "{word} in {expr}"
                );
            }
        }
    }
}

/// The shipped alert rules load in Prometheus and watch families the server exports.
#[test]
fn alert_rules_check_and_name_real_families() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/overspill-alerts.yml");
    let out = Command::new("promtool")
        .args(["check", "rules", path])
        .output()
        .unwrap_or_else(|e| panic!("promtool is not installed (apt-get install prometheus): {e}"));
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(path).expect("rules");
    let exprs: Vec<String> = text.lines().filter_map(|l| l.trim().strip_prefix("expr: ").map(str::to_owned)).collect();
    assert!(exprs.len() >= 5, "{exprs:?}");
    assert_real_families(&exprs);
}
