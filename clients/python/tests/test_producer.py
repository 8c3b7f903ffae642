"""The Python producer client against a database the real laneway binary
migrated, on SQLite (stdlib sqlite3) and PostgreSQL (psycopg 3): enqueue in
the caller's transaction, commit and rollback, idempotency, and a typed
error for each refusal.

Needs LW_LANEWAY_BIN (the laneway binary; ./dev test sets it) and
TEST_PG_URL (default postgres://postgres@127.0.0.1:5432/test).
"""

import datetime as dt
import os
import sqlite3
import subprocess
import sys
import tempfile
import unittest
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import laneway_producer as lw  # noqa: E402

PG_URL = os.environ.get("TEST_PG_URL", "postgres://postgres@127.0.0.1:5432/test")
CONFIG = """
[queue]
max_payload_bytes = 4096
[kinds.email]
lanes = "optional"
"""


def migrate(url, extra=""):
    binary = os.environ.get("LW_LANEWAY_BIN")
    if not binary:
        raise RuntimeError("LW_LANEWAY_BIN must name the laneway binary (./dev test sets it)")
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(f'[database]\nurl = "{url}"\n{extra}\n{CONFIG}')
        path = f.name
    try:
        subprocess.run([binary, "--config", path, "migrate"], check=True, capture_output=True, text=True)
    finally:
        os.unlink(path)


class Cases:
    """The same cases on each backend; `begin`, `commit`, `rollback` and
    `count` are the backend's."""

    def test_the_op_commits_and_rolls_back_with_the_callers_transaction(self):
        for commit in (True, False):
            self.begin()
            self.business_row()
            op_id = lw.enqueue(self.conn, schema=self.schema, kind="email", outbox="shop", payload={"commit": commit})
            self.assertGreater(op_id, 0)
            self.commit() if commit else self.rollback()
        self.assertEqual(self.count("shop"), 1)
        self.assertEqual(self.business_rows(), 1)

    def test_a_repeated_key_is_the_same_op_and_a_reused_one_is_refused(self):
        self.begin()
        first = lw.enqueue(self.conn, schema=self.schema, kind="email", outbox="o", payload={"n": 1}, idempotency_key="k")
        again = lw.enqueue(self.conn, schema=self.schema, kind="email", outbox="o", payload={"n": 1}, idempotency_key="k")
        self.assertEqual(first, again)
        self.commit()
        self.begin()
        with self.assertRaises(lw.IdempotencyConflict) as caught:
            lw.enqueue(self.conn, schema=self.schema, kind="email", outbox="o", payload={"n": 2}, idempotency_key="k")
        self.assertIn("idempotency", str(caught.exception))
        self.rollback()

    def test_each_refusal_is_typed_and_writes_nothing(self):
        cases = [
            (lw.UnknownKind, dict(kind="emial", outbox="r", payload={})),
            (lw.LanesRequired, dict(kind="activitypub", outbox="r", payload={})),
            (lw.LanesRequired, dict(kind="withdraw", outbox="r", payload={})),
            (lw.PayloadTooLarge, dict(kind="email", outbox="r", payload="x" * 5000)),
            (lw.InvalidOp, dict(kind="email", outbox="", payload={})),
            (lw.InvalidOp, dict(kind="email", outbox="r", payload={}, lanes=[""])),
            (lw.InvalidOp, dict(kind="email", outbox="r", payload={}, idempotency_key=b"bytes")),
            (lw.InvalidOp, dict(kind="email", outbox="r", payload={}, priority="urgent")),
            (lw.InvalidOp, dict(kind="email", outbox="r", payload={}, delay_ms=-1)),
            (lw.InternalKind, dict(kind="outcome_webhook", outbox="r", payload={})),
        ]
        for error, fields in cases:
            with self.subTest(error=error.__name__, fields=fields):
                self.begin()
                try:
                    with self.assertRaises(error):
                        lw.enqueue(self.conn, schema=self.schema, **fields)
                finally:
                    self.rollback()
        self.assertEqual(self.count("r"), 0)

    def test_priority_defaults_to_the_kinds_and_delay_is_milliseconds(self):
        self.begin()
        critical = lw.enqueue(self.conn, schema=self.schema, kind="withdraw", outbox="p", payload={}, lanes=["GSIGNER"])
        later = lw.enqueue(self.conn, schema=self.schema, kind="email", outbox="p", payload={}, delay_ms=3_600_000)
        ids = lw.enqueue_many(
            self.conn,
            [dict(kind="email", outbox="p", payload=[1], priority="low"), lw.Op(kind="email", outbox="q", payload=None)],
            schema=self.schema,
        )
        self.commit()
        self.assertEqual(self.priority(critical), 0)
        self.assertEqual(self.priority(ids[0]), 2)
        self.assertEqual(len(ids), 2)
        wait = self.delay_seconds(later)
        self.assertTrue(3590 <= wait <= 3610, wait)
        self.assertEqual(lw.contract_version(self.conn, schema=self.schema), lw.CONTRACT_VERSION)


class Sqlite(Cases, unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        path = Path(self.dir.name) / "app.db"
        migrate(f"sqlite://{path}")
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        self.schema = "laneway"

    def tearDown(self):
        self.conn.close()
        self.dir.cleanup()

    def begin(self):
        self.conn.execute("BEGIN IMMEDIATE")

    def commit(self):
        self.conn.execute("COMMIT")

    def rollback(self):
        self.conn.execute("ROLLBACK")

    def business_row(self):
        self.conn.execute("INSERT INTO orders DEFAULT VALUES")

    def business_rows(self):
        return self.conn.execute("SELECT count(*) FROM orders").fetchone()[0]

    def count(self, outbox):
        return self.conn.execute("SELECT count(*) FROM laneway_ops WHERE outbox = ?", (outbox,)).fetchone()[0]

    def priority(self, op_id):
        return self.conn.execute("SELECT priority FROM laneway_ops WHERE id = ?", (op_id,)).fetchone()[0]

    def delay_seconds(self, op_id):
        row = self.conn.execute("SELECT next_attempt_at - created_at FROM laneway_ops WHERE id = ?", (op_id,)).fetchone()
        return row[0] / 1000


class Postgres(Cases, unittest.TestCase):
    def setUp(self):
        import psycopg

        self.schema = f"lwpy_{uuid.uuid4().hex[:12]}"
        migrate(PG_URL, f'schema = "{self.schema}"')
        self.conn = psycopg.connect(PG_URL, autocommit=True)
        self.conn.execute(f"CREATE TABLE {self.schema}_orders (id serial PRIMARY KEY)")

    def tearDown(self):
        self.conn.execute(f"DROP TABLE IF EXISTS {self.schema}_orders")
        self.conn.execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE")
        self.conn.close()

    def begin(self):
        self.conn.execute("BEGIN")

    def commit(self):
        self.conn.execute("COMMIT")

    def rollback(self):
        self.conn.execute("ROLLBACK")

    def business_row(self):
        self.conn.execute(f"INSERT INTO {self.schema}_orders DEFAULT VALUES")

    def business_rows(self):
        return self.conn.execute(f"SELECT count(*) FROM {self.schema}_orders").fetchone()[0]

    def count(self, outbox):
        return self.conn.execute(f"SELECT count(*) FROM {self.schema}.ops WHERE outbox = %s", (outbox,)).fetchone()[0]

    def priority(self, op_id):
        return self.conn.execute(f"SELECT priority FROM {self.schema}.ops WHERE id = %s", (op_id,)).fetchone()[0]

    def delay_seconds(self, op_id):
        row = self.conn.execute(
            f"SELECT extract(epoch FROM next_attempt_at - created_at) FROM {self.schema}.ops WHERE id = %s", (op_id,)
        ).fetchone()
        return float(row[0])


if __name__ == "__main__":
    unittest.main()
