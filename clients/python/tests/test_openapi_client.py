"""A Python client generated from a running laneway's /api/openapi.json with
openapi-python-client, as a producer team would make one, calls the binary:
one op with any JSON payload, a batch, a refusal read as the typed error
body, and a page of the outcome feed.

Needs LW_LANEWAY_BIN and the openapi-python-client package (./dev test
installs it).
"""

import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request
from pathlib import Path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GeneratedClient(unittest.TestCase):
    def setUp(self):
        binary = os.environ.get("LW_LANEWAY_BIN")
        if not binary:
            raise RuntimeError("LW_LANEWAY_BIN must name the laneway binary (./dev test sets it)")
        self.dir = tempfile.TemporaryDirectory()
        d = Path(self.dir.name)
        port = free_port()
        config = d / "laneway.toml"
        config.write_text(
            f'[database]\nurl = "sqlite://{d / "q.db"}"\n[api]\nlisten = "127.0.0.1:{port}"\n'
            '[kinds.email]\nlanes = "optional"\n'
        )
        run = lambda *args: subprocess.run([binary, "--config", str(config), *args], check=True, capture_output=True, text=True)
        run("migrate")
        self.key = json.loads(
            run("api-keys", "new", "--name", "gen", "--scopes", "ops:write,outcomes:read", "--json").stdout
        )["secret"]
        self.host = subprocess.Popen([binary, "--config", str(config), "run"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{self.base}/healthz", timeout=1)
                break
            except OSError:
                if self.host.poll() is not None:
                    raise RuntimeError("laneway run exited")
                time.sleep(0.1)
        document = d / "openapi.json"
        document.write_bytes(urllib.request.urlopen(f"{self.base}/api/openapi.json", timeout=5).read())
        subprocess.run(
            [sys.executable, "-m", "openapi_python_client", "generate", "--path", str(document), "--output-path", str(d / "gen"),
             "--meta", "none"],
            check=True,
            capture_output=True,
            text=True,
        )
        sys.path.insert(0, str(d))
        self.package = "gen"

    def tearDown(self):
        self.host.kill()
        self.host.wait()
        sys.path.remove(self.dir.name)
        for name in [m for m in sys.modules if m == "gen" or m.startswith("gen.")]:
            del sys.modules[name]
        self.dir.cleanup()

    def test_the_generated_client_enqueues_and_reads_outcomes(self):
        client_mod = importlib.import_module("gen.client")
        enqueue = importlib.import_module("gen.api.producer.enqueue")
        feed = importlib.import_module("gen.api.producer.feed")
        models = importlib.import_module("gen.models")
        client = client_mod.AuthenticatedClient(base_url=self.base, token=self.key)

        one = models.OpBody.from_dict(
            {"kind": "email", "outbox": "shop", "lanes": ["c-3"], "payload": {"order": "o-17", "items": [1, 2]}}
        )
        answer = enqueue.sync_detailed(client=client, body=one)
        self.assertEqual(answer.status_code, 201, answer.content)
        created = json.loads(answer.content)
        self.assertEqual(created["status"], "created")
        self.assertGreater(created["id"], 0)

        batch = models.OpBatch.from_dict(
            {"ops": [{"kind": "email", "outbox": "shop", "payload": [1, "two", None]}, {"kind": "email", "outbox": "shop", "payload": None}]}
        )
        answer = enqueue.sync_detailed(client=client, body=batch)
        self.assertEqual(answer.status_code, 200, answer.content)
        self.assertEqual(len(json.loads(answer.content)["results"]), 2)

        refused = enqueue.sync_detailed(client=client, body=models.OpBody.from_dict({"kind": "emial", "outbox": "shop", "payload": {}}))
        self.assertEqual(refused.status_code, 422)
        self.assertEqual(json.loads(refused.content)["error"]["code"], "unknown_kind")

        page = feed.sync_detailed(client=client, outbox="shop")
        self.assertEqual(page.status_code, 200, page.content)
        self.assertIn("outcomes", json.loads(page.content))


if __name__ == "__main__":
    unittest.main()
