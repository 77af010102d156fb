"""Run one command in a sandhold sandbox using plain nats-py (no sandhold imports).

Usage: python plain_nats.py nats://127.0.0.1:4222 .sandhold/credentials/operator.json
"""

import asyncio
import json
import sys
import uuid

import nats

PREFIX = "sh"  # subjects sh.*, streams SH_*


async def send(nc, js, body: dict) -> dict:
    """Publish a request to the REQUESTS stream and wait for the scheduler's reply."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)  # listen before publishing
    headers = {
        # New for every call; reuse it only to re-publish this same call.
        "Nats-Msg-Id": f"{body['key']}:{uuid.uuid4().hex}",
        "Sh-Reply": inbox,  # where the scheduler answers
    }
    data = json.dumps(body).encode()
    # The tenant is the subject's last token (the operator acts as "default").
    tenant = body.get("tenant", "default").replace(".", "~")
    await js.publish(f"{PREFIX}.req.{body['type']}.{tenant}", data, headers=headers)
    reply = json.loads((await sub.next_msg(timeout=30)).data)
    if not reply["ok"]:
        sys.exit(f"refused: {reply['error']['code']}: {reply['error']['message']}")
    return reply


async def main(url: str, credential_file: str) -> None:
    # Every client has a user (here the operator's, made by `sandhold up`); its
    # permissions let it read replies on its own inbox prefix only.
    with open(credential_file) as f:
        me = json.load(f)
    nc = await nats.connect(
        url, user=me["user"], password=me["password"], inbox_prefix=f"_INBOX.{me['user']}"
    )
    js = nc.jetstream()

    # 1. Create a sandbox. The key makes the request safe to retry.
    reply = await send(nc, js, {"type": "sandbox.create", "key": f"create-{uuid.uuid4()}"})
    sandbox_id = reply["sandbox"]["id"]
    print(f"sandbox {sandbox_id} is {reply['sandbox']['phase']}")

    # 2. Follow the sandbox's events from the start of its subject (ordered consumer).
    events = await js.subscribe(
        f"{PREFIX}.ev.sandbox.{sandbox_id}", stream="SH_EVENTS", ordered_consumer=True
    )

    async def next_event() -> dict:
        envelope = json.loads((await events.next_msg(timeout=30)).data)
        return envelope["event"]  # {"type": "...", ...fields}

    while (event := await next_event())["type"] != "sandbox.started":
        if event["type"] == "sandbox.start_failed":
            sys.exit(f"sandbox failed to start: {event['reason']}")
    print(f"sandbox {sandbox_id} is running")

    # 3. Run a command. The reply carries its id (also derivable from the key).
    reply = await send(
        nc,
        js,
        {
            "type": "command.run",
            "key": f"run-{uuid.uuid4()}",
            "sandbox_id": sandbox_id,
            "argv": ["sh", "-c", "echo hello from sandhold; exit 3"],
        },
    )
    command_id = reply["command"]["id"]
    print(f"command {command_id} is {reply['command']['state']}")

    # 4. Wait for its end state on the same event subscription.
    while True:
        event = await next_event()
        if event["type"] == "command.ended" and event["command_id"] == command_id:
            break
    await events.unsubscribe()

    # 5. Read the kept output: raw chunks on sh.out.<sandbox>.<command>.<stream>,
    #    placed by their Sh-Offset header, until output_kept bytes per stream.
    kept = event["output_kept"]  # e.g. {"stdout": 20, "stderr": 0}
    output = {name: b"" for name in kept}
    if any(kept.values()):
        chunks = await js.subscribe(
            f"{PREFIX}.out.{sandbox_id}.{command_id}.*",
            stream="SH_OUTPUT",
            ordered_consumer=True,
        )
        while any(len(output[name]) < size for name, size in kept.items()):
            msg = await chunks.next_msg(timeout=30)
            name, offset = msg.headers["Sh-Stream"], int(msg.headers["Sh-Offset"])
            if offset <= len(output[name]):  # skip bytes we already have
                output[name] += msg.data[len(output[name]) - offset :]
        await chunks.unsubscribe()
    for name, data in output.items():
        print(f"{name}: {data.decode(errors='replace')!r}")
    if not event["output_complete"]:
        print("newer output may have been lost")

    print(f"command ended: state={event['state']} exit_code={event['exit_code']}")

    # 6. Clean up: delete the sandbox (not waiting for it to go).
    await send(
        nc,
        js,
        {"type": "sandbox.delete", "key": f"delete-{uuid.uuid4()}", "sandbox_id": sandbox_id},
    )
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
