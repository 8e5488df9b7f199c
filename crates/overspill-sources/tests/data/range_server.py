#!/usr/bin/env python3
"""A small web server for the HTTP source's tests: serves the files of a directory with single
byte ranges (206 and Content-Range), ETag and Last-Modified, and honours If-Match and
If-Unmodified-Since, as nginx, Apache and S3 do. Python's http.server has none of that.

Prints "listening on PORT" once it listens (PORT 0 picks a free one). Options:
  --no-etag            send no ETag (the client falls back to Last-Modified)
  --no-validators      send neither ETag nor Last-Modified
  --validators-on-get-only  send them on GET replies, not on HEAD
  --no-last-modified-on-206  send no Last-Modified with a range (RFC 9110 asks only for the ETag)
  --ignore-conditions  answer as if If-Match and If-Unmodified-Since were not sent
  --no-head            refuse HEAD with 403, as a URL presigned for GET does
  --fail-every N       answer every Nth GET with 503 (a flaky server)
  --claim-size N       say the files are N bytes long (HEAD, and the total in Content-Range)
  --tls CERT KEY       serve HTTPS
  --s3 BUCKET          answer path-style S3 requests, /BUCKET/NAME, as an S3 store would
                       (authentication is not checked)
  --misbehave HOW      after the first --after N ranged GETs (default 1), answer them wrongly:
                       shifted-range (a Content-Range one byte on), cut-body (close the
                       connection half way), long-body (100 bytes more than asked), gzip (say
                       Content-Encoding: gzip), redirect (302 to the same file, then serve it),
                       endless-body (say a body of 1 TiB and send zeroes after the range until
                       the client hangs up; says on stderr how much it sent)
Standard library only.
"""

import argparse
import email.utils
import http.server
import os
import re
import ssl
import sys
import threading
import urllib.parse

RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def make_handler(root, options):
    gets = {"count": 0}
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        # Keep-alive, as clients expect of real servers; every reply has a Content-Length.
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            sys.stderr.write("range_server: " + (fmt % args) + "\n")

        def reply(self, status, headers=(), body=b"", length=None):
            """Sends a reply; `length` is the Content-Length when it is not the body's (HEAD)."""
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def file(self):
            # The query (a presigned URL's signature) is not part of the file's name.
            name = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
            if options.s3:
                bucket, _, name = name.partition("/")
                if bucket != options.s3:
                    return None
            if not name or "/" in name or name.startswith("."):
                return None
            path = os.path.join(root, name)
            return path if os.path.isfile(path) else None

        def do_HEAD(self):
            if options.no_head:
                self.reply(403)
                return
            self.serve()

        def do_GET(self):
            with lock:
                gets["count"] += 1
                fail = options.fail_every and gets["count"] % options.fail_every == 0
                if "Range" in self.headers:
                    gets["ranged"] = gets.get("ranged", 0) + 1
                misbehave = options.misbehave if gets.get("ranged", 0) > options.after else None
            if fail:
                self.reply(503, body=b"try again\n")
                return
            if misbehave == "redirect" and "r=1" not in self.path:
                self.reply(302, [("Location", urllib.parse.urlsplit(self.path).path + "?r=1")])
                return
            self.serve(misbehave)

        def serve(self, misbehave=None):
            path = self.file()
            if path is None:
                self.reply(404, body=b"not found\n")
                return
            # Opened once: what is sent and what is described are the same file, even if it
            # is replaced meanwhile.
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                etag = '"%x-%x-%x"' % (st.st_ino, st.st_mtime_ns, size)
                modified = email.utils.formatdate(st.st_mtime, usegmt=True)
                validators = [("Last-Modified", modified)]
                if not options.no_etag:
                    validators.append(("ETag", etag))
                if options.no_validators or (options.validators_on_get_only and self.command == "HEAD"):
                    validators = []
                if not options.ignore_conditions and not self.preconditions_hold(etag, st.st_mtime):
                    self.reply(412, validators)
                    return
                headers = validators + [("Accept-Ranges", "bytes"), ("Content-Type", "application/octet-stream")]
                # What is said of the file's length; past the file's end its ranges read zeroes.
                claimed = options.claim_size or size
                asked = self.headers.get("Range")
                if asked is None:
                    self.whole(f, claimed, headers)
                    return
                match = RANGE.match(asked.strip())
                if match is None:
                    # Several ranges, or another unit: a server may ignore such a header.
                    self.whole(f, size, headers)
                    return
                first, last = match.groups()
                if first == "":
                    # bytes=-N: the last N bytes.
                    first, last = max(0, claimed - int(last)), claimed - 1
                else:
                    first = int(first)
                    last = claimed - 1 if last == "" else min(int(last), claimed - 1)
                if first >= claimed or first > last:
                    self.reply(416, validators + [("Content-Range", "bytes */%d" % claimed)])
                    return
                f.seek(min(first, size))
                if options.no_last_modified_on_206:
                    headers = [h for h in headers if h[0] != "Last-Modified"]
                shift = 1 if misbehave == "shifted-range" else 0
                headers.append(("Content-Range", "bytes %d-%d/%d" % (first + shift, last + shift, claimed)))
                if misbehave == "gzip":
                    headers.append(("Content-Encoding", "gzip"))
                body = f.read(last - first + 1)
                body += b"\0" * (last - first + 1 - len(body))
                if self.command == "HEAD":
                    self.reply(206, headers, length=len(body))
                elif misbehave == "endless-body":
                    self.send_response(206)
                    for name, value in headers:
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(1 << 40))
                    self.end_headers()
                    sent = 0
                    try:
                        self.wfile.write(body)
                        sent = len(body)
                        while sent < 1 << 40:
                            self.wfile.write(b"\0" * 65536)
                            sent += 65536
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    sys.stderr.write("range_server: endless body: %d bytes sent\n" % sent)
                    self.close_connection = True
                elif misbehave == "long-body":
                    self.reply(206, headers, body + b"\0" * 100)
                elif misbehave == "cut-body":
                    self.send_response(206)
                    for name, value in headers:
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                else:
                    self.reply(206, headers, body)

        def whole(self, f, size, headers):
            if self.command == "HEAD":
                self.reply(200, headers, length=size)
            else:
                self.reply(200, headers, f.read())

        def preconditions_hold(self, etag, mtime):
            if_match = self.headers.get("If-Match")
            if if_match is not None:
                tags = [t.strip() for t in if_match.split(",")]
                return "*" in tags or (not options.no_etag and etag in tags)
            since = self.headers.get("If-Unmodified-Since")
            if since is not None:
                try:
                    limit = email.utils.parsedate_to_datetime(since).timestamp()
                except (TypeError, ValueError):
                    return True
                return int(mtime) <= limit
            return True

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--no-etag", action="store_true")
    parser.add_argument("--no-validators", action="store_true")
    parser.add_argument("--validators-on-get-only", action="store_true")
    parser.add_argument("--no-last-modified-on-206", action="store_true")
    parser.add_argument("--ignore-conditions", action="store_true")
    parser.add_argument("--no-head", action="store_true")
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--claim-size", type=int, default=0)
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    parser.add_argument("--s3", metavar="BUCKET")
    parser.add_argument("--misbehave", choices=["shifted-range", "cut-body", "long-body", "gzip", "redirect", "endless-body"])
    parser.add_argument("--after", type=int, default=1)
    options = parser.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", options.port), make_handler(options.dir, options))
    server.daemon_threads = True
    if options.tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*options.tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    print("listening on %d" % server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
