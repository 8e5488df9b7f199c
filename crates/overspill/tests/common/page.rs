//! HTML report pages as a reader sees them: every SVG chart parses, and headless Chromium
//! renders the page to a screenshot whose pixels a test can count.

use std::path::Path;
use std::process::Command;

/// How many SVG charts the page has; panics naming the first that is not well-formed XML.
pub fn parsed_svgs(html: &str) -> usize {
    let mut svgs = 0;
    let mut rest = html;
    while let Some(start) = rest.find("<svg") {
        let end = rest[start..].find("</svg>").map(|e| start + e + 6).expect("an SVG ends");
        let mut reader = quick_xml::Reader::from_str(&rest[start..end]);
        loop {
            match reader.read_event() {
                Ok(quick_xml::events::Event::Eof) => break,
                Ok(_) => {}
                Err(error) => panic!("SVG {svgs} does not parse: {error}"),
            }
        }
        svgs += 1;
        rest = &rest[end..];
    }
    svgs
}

/// Renders `page` in headless Chromium at `width`×`height` into `shot` and returns its pixels
/// as RGB triples, after checking the page is not (nearly) blank.
pub fn rendered_pixels(page: &Path, shot: &Path, width: u32, height: u32) -> Vec<[u8; 3]> {
    let browser = Command::new("chromium-headless-shell")
        .args(["--no-sandbox", "--disable-gpu", "--hide-scrollbars", &format!("--window-size={width},{height}")])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("chromium-headless-shell (scripts/test installs it)");
    assert!(browser.status.success(), "chromium: {}", String::from_utf8_lossy(&browser.stderr));
    let file = std::fs::File::open(shot).expect("screenshot");
    let mut reader = png::Decoder::new(std::io::BufReader::new(file)).read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size()];
    let frame = reader.next_frame(&mut buf).expect("a frame");
    let channels = frame.line_size / frame.width as usize;
    assert!(channels >= 3 && frame.bit_depth == png::BitDepth::Eight, "{:?} {:?}", frame.color_type, frame.bit_depth);
    let pixels: Vec<[u8; 3]> = buf[..frame.buffer_size()].chunks_exact(channels).map(|p| [p[0], p[1], p[2]]).collect();
    let inked = pixels.iter().filter(|p| p.iter().any(|&c| c < 240)).count();
    eprintln!("screenshot of {}: {} pixels, {inked} not white", page.display(), pixels.len());
    assert!(inked * 20 > pixels.len(), "the page rendered almost blank: {inked} of {} pixels", pixels.len());
    pixels
}
