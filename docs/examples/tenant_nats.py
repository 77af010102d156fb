"""Run one command as a tenant over NATS, using plain nats-py (no sandhold imports).

Usage: python tenant_nats.py nats://127.0.0.1:4222 acme.creds
(`sandhold credentials create --tenant acme --out acme.creds` makes the file.)
"""

import asyncio
import json
import sys
import uuid

import nats

PREFIX = "sh"


async def main(url: str, credential_file: str) -> None:
    # A tenant's user may send calls to sh.api.<tenant> and read its own inbox:
    # nothing else on the bus (no JetStream API, no other tenant's subjects).
    with open(credential_file) as f:
        me = json.load(f)
    nc = await nats.connect(
        url, user=me["user"], password=me["password"], inbox_prefix=f"_INBOX.{me['user']}"
    )
    api = f"{PREFIX}.api.{me['tenant'].replace('.', '~')}"

    async def call(method: str, path: str, body=None, **headers) -> dict:
        """One HTTP API call (docs/api.md §1) as a NATS request; the answer
        carries the HTTP status, headers and JSON body."""
        payload = {"method": method, "path": path, "headers": headers}
        if body is not None:
            payload["body"] = body
        msg = await nc.request(api, json.dumps(payload).encode(), timeout=90)
        answer = json.loads(msg.data)
        if answer["status"] >= 400:
            problem = answer["body"]
            sys.exit(f"{method} {path}: {answer['status']} {problem['code']}: {problem['detail']}")
        return answer["body"]

    # 1. Create a sandbox; the Idempotency-Key makes the call safe to retry.
    sandbox = await call("POST", "/api/v1/sandboxes", **{"Idempotency-Key": str(uuid.uuid4())})
    sandbox_id = sandbox["id"]

    # 2. Run a command (it waits in the queue until the sandbox runs).
    command = await call(
        "POST",
        f"/api/v1/sandboxes/{sandbox_id}/commands",
        {"argv": ["sh", "-c", "echo hello from a tenant; exit 3"]},
        **{"Idempotency-Key": str(uuid.uuid4())},
    )
    print(f"command {command['id']} is {command['state']}")

    # 3. Follow the sandbox's events, a page at a time (long polling), until the
    #    command's end: each page says where the next one starts.
    after = 0
    while True:
        page = await call("GET", f"/api/v1/sandboxes/{sandbox_id}/events?after={after}&wait=20")
        after = page["last_event_id"]
        ends = [
            e["event"]
            for e in page["events"]
            if e["type"] == "command.ended" and e["event"]["command_id"] == command["id"]
        ]
        if ends:
            break

    # 4. Its kept output, and its end state.
    output = await call("GET", f"/api/v1/sandboxes/{sandbox_id}/commands/{command['id']}/output")
    print(f"stdout: {output['stdout']!r}")
    print(f"command ended: state={ends[0]['state']} exit_code={ends[0]['exit_code']}")

    await call("DELETE", f"/api/v1/sandboxes/{sandbox_id}")
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
