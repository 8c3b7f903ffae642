#!/usr/bin/env python3
"""A webhook receiver that verifies every request with the Standard Webhooks
reference implementation (the `standardwebhooks` package on PyPI), not with
laneway's code. For the tests: it prints its port, then appends one JSON line
per request to OUTFILE ({"ok": true, "id", "payload"} or {"ok": false,
"error"}) and answers 204 or 400. With FAIL_FIRST, its first FAIL_FIRST
requests are answered 503 (recorded as {"ok": false, "error": "503"}).

    webhook_receiver.py SECRET OUTFILE [FAIL_FIRST]
"""
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook

SECRET, OUTFILE = sys.argv[1], sys.argv[2]
FAIL_FIRST = [int(sys.argv[3]) if len(sys.argv) > 3 else 0]
HOOK = Webhook(SECRET)
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        headers = {k.lower(): v for k, v in self.headers.items()}
        with LOCK:
            failing = FAIL_FIRST[0] > 0
            if failing:
                FAIL_FIRST[0] -= 1
        if failing:
            with open(OUTFILE, "a", encoding="utf-8") as out:
                out.write(json.dumps({"ok": False, "error": "503", "id": headers.get("webhook-id")}) + "\n")
            self.send_response(503)
            self.end_headers()
            return
        try:
            payload = HOOK.verify(body, headers)
            record, status = {"ok": True, "id": headers.get("webhook-id"), "payload": payload}, 204
        except Exception as e:  # any refusal is the test's finding
            record, status = {"ok": False, "error": repr(e)}, 400
        with open(OUTFILE, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
