"""A shop that sends an order confirmation through laneway, in Python.

The order row and the email's op commit in one transaction; an order whose
transaction fails leaves no op. The outcome comes back through laneway's
outcome feed, filtered to the shop's outbox.

    LW_API_KEY=lw_... python3 examples/producers/shop.py sqlite://shop.db
    LW_API_KEY=lw_... python3 examples/producers/shop.py postgres://user@host/db

(laneway running with examples/producers/laneway.toml; see that file.)
"""

import json
import os
import sqlite3
import sys
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients/python/src"))
import laneway_producer as lw  # noqa: E402

API = os.environ.get("LW_API", "http://127.0.0.1:7480")


def connect(url):
    if url.startswith("sqlite://"):
        conn = sqlite3.connect(url.removeprefix("sqlite://"), isolation_level=None)
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT NOT NULL)")
        return conn, "BEGIN IMMEDIATE"
    import psycopg

    conn = psycopg.connect(url, autocommit=True)
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, customer TEXT NOT NULL)")
    return conn, "BEGIN"


def place_order(conn, begin, order, customer, fail=False):
    """The business write and its side effect's op, in one transaction."""
    conn.execute(begin)
    try:
        mark = "?" if isinstance(conn, sqlite3.Connection) else "%s"
        conn.execute(f"INSERT INTO orders (id, customer) VALUES ({mark}, {mark})", (order, customer))
        op_id = lw.enqueue(
            conn,
            kind="email",
            outbox="shop",
            payload={"to": customer, "template": "order-confirmed", "order": order},
            lanes=[f"customer:{customer}"],
            idempotency_key=f"order-confirmed:{order}",
            correlation_id=order,
        )
        if fail:
            raise RuntimeError("the payment was declined")
        conn.execute("COMMIT")
        return op_id
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def outcome(op_id, timeout=30.0):
    """Follows the outcome feed (this outbox only) until the op is terminal."""
    key = os.environ["LW_API_KEY"]
    after, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        query = "outbox=shop" + (f"&after={after}" if after else "")
        request = urllib.request.Request(f"{API}/api/v1/outcomes?{query}", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            page = json.load(answer)
        for entry in page["outcomes"]:
            if entry["op"]["id"] == op_id:
                return entry
        after = page["next"] or after
        time.sleep(0.2)
    raise TimeoutError(f"op {op_id} reached no outcome in {timeout} s")


def main():
    conn, begin = connect(sys.argv[1] if len(sys.argv) > 1 else "sqlite://shop.db")
    order = f"o-{uuid.uuid4().hex[:8]}"
    op_id = place_order(conn, begin, order, "c-3")
    print(f"order {order} committed with op {op_id}")
    try:
        place_order(conn, begin, order + "-declined", "c-4", fail=True)
    except RuntimeError as e:
        print(f"order {order}-declined rolled back ({e}); no op was enqueued for it")
    entry = outcome(op_id)
    print(f"op {op_id}: {entry['status']} after {entry['op']['attempts']} attempt(s)")
    return 0 if entry["status"] == "confirmed" else 1


if __name__ == "__main__":
    sys.exit(main())
