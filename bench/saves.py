"""(e) Saves: freeze window, save time, save and restore throughput vs raw NATS.

A workspace of random 4 MiB files (1 GiB; 256 MiB with `--quick`) inside a real
`ProcessDriver` sandbox with a command running in it, one fresh nats-server
(`sync_interval: always`), the SAVES stream from `ensure_streams`. Each round:

* a full (first) save as the host-agent does it (`saving.py`): `driver.freeze`
  → `capture(...)` in a thread → `driver.thaw`, then `store.upload` +
  `put_manifest`; next to it, the baseline: the same bytes as 256 KiB chunks
  read from the workspace files and sent with plain `js.publish` (no hashing,
  no capture, no spool, no fence), 32 in flight like `upload`, to a stream
  configured like SAVES on the same server;
* `restore(...)` of that save into a new directory; next to it, the baseline:
  concurrent `js.get_msg(..., direct=True)` of the same chunk subjects, 32 in
  flight, nothing hashed or written.

Then incremental saves with 10 MiB changed since the previous save (1 MiB
overwritten in each of 10 files), the freeze window and the total save time
timed, and `tar -cf` of the workspace to local disk for reference.

    uv run python bench/saves.py [--quick] [--write]
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import nats
from _common import (
    CpuMeter,
    arguments,
    emit,
    median,
    ms,
    nats_server,
    nproc,
    table,
    temp_dir,
    verdict,
)
from nats.js.api import Header, RetentionPolicy, StorageType, StreamConfig
from sandhold.bus.names import Names
from sandhold.bus.streams import ensure_streams
from sandhold.hostagent.driver import ProcessDriver
from sandhold.saves import DEFAULT_CHUNK_SIZE, SaveStore, capture, restore, store_capture
from sandhold.saves.chunking import Chunker

MiB = 1024 * 1024
FILE_BYTES = 4 * MiB
CHUNK = DEFAULT_CHUNK_SIZE
CONCURRENCY = 32  # what `SaveStore.upload` and `restore` use by default
CHANGED_FILES, CHANGED_PER_FILE = 10, MiB  # 10 MiB changed per incremental save
GOAL_FREEZE_MS = 100.0
GOAL_SAVE_S = 1.0
GOAL_RATIO = 0.7
SID = "sb-00000000000e5a7e"
TICKER = "while :; do date +%s%N > ticker; sleep 0.05; done"


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds if seconds > 0 else float("nan")


def make_workspace(workspace: Path, files: int) -> None:
    for i in range(files):
        sub = workspace / f"d{i // 32:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:04d}.bin").write_bytes(os.urandom(FILE_BYTES))


def change_workspace(workspace: Path, files: int, round_no: int) -> None:
    """Overwrite 1 MiB in each of 10 files (different files each round)."""
    paths = sorted(workspace.glob("d*/f*.bin"))
    for k in range(CHANGED_FILES):
        path = paths[(round_no * CHANGED_FILES + k * 7) % len(paths)]
        with open(path, "r+b") as f:
            f.seek(((round_no + k) % (FILE_BYTES // CHANGED_PER_FILE)) * CHANGED_PER_FILE)
            f.write(os.urandom(CHANGED_PER_FILE))


async def one_save(
    driver: ProcessDriver,
    store: SaveStore,
    spool_root: Path,
    save_id: str,
    previous,
    server_pid: int | None,
) -> dict:
    """What `HostSaves.save` does, timed step by step."""
    spool = spool_root / save_id
    t0 = time.perf_counter()
    await driver.freeze(SID)
    t1 = time.perf_counter()
    try:
        captured = await asyncio.to_thread(
            capture,
            driver.workspace(SID),
            save_id=save_id,
            sandbox_id=SID,
            previous=previous,
            spool=spool,
            now=time.time(),
            defer_hashing=True,  # as the host-agent does: copy while frozen, hash after
        )
        t2 = time.perf_counter()
    finally:
        await driver.thaw(SID)
    t3 = time.perf_counter()
    with CpuMeter(server_pid) as cpu:
        # "upload" below includes cutting and hashing the copies, in the same pass
        captured, uploaded = await store_capture(store, captured)
        t4 = time.perf_counter()
        await store.put_manifest(captured.manifest)
    t5 = time.perf_counter()
    shutil.rmtree(spool, ignore_errors=True)
    return {
        "freeze": t1 - t0,
        "capture": t2 - t1,
        "thaw": t3 - t2,
        "window": t3 - t0,
        "upload": t4 - t3,
        "manifest": t5 - t4,
        "total": t5 - t0,
        "manifest_obj": captured.manifest,
        "changed_bytes": captured.changed_bytes,
        "changed_files": captured.changed_files,
        "new_chunks": len(captured.new_chunks),
        "uploaded_bytes": uploaded.uploaded_bytes,
        "uploaded_chunks": uploaded.uploaded_chunks,
        "client_cpu": cpu.client,
        "server_cpu": cpu.others[0],
    }


def chunk_plan(workspace: Path) -> list[tuple[Path, int, int]]:
    plan = []
    for path in sorted(workspace.rglob("*.bin")):
        size = path.stat().st_size
        plan += [(path, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
    return plan


async def raw_upload(
    js, stream: str, prefix: str, plan, server_pid: int | None, fence: bool = False
) -> tuple:
    """The same bytes as 256 KiB chunks: pread from the workspace, plain `js.publish`
    (with `fence`: plus the headers `put_new` sends, expected subject sequence 0
    and a msg id, to split the server's share from the client's)."""
    await js.add_stream(
        StreamConfig(
            name=stream,
            subjects=[f"{prefix}.chunk.*"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_msgs_per_subject=1,
            allow_direct=True,
            duplicate_window=120,
        )
    )
    todo = iter(enumerate(plan))
    fds: dict[Path, int] = {}

    async def worker() -> None:
        for i, (path, offset, length) in todo:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            data = os.pread(fd, length, offset)
            subject = f"{prefix}.chunk.{i:064x}"
            headers = (
                {Header.EXPECTED_LAST_SUBJECT_SEQUENCE: "0", Header.MSG_ID: subject}
                if fence
                else None
            )
            await js.publish(subject, data, stream=stream, headers=headers)

    try:
        started = time.perf_counter()
        with CpuMeter(server_pid) as cpu:
            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - started
    finally:
        for fd in fds.values():
            os.close(fd)
    info = await js.stream_info(stream)
    if info.state.messages != len(plan):
        raise RuntimeError(f"raw upload: {info.state.messages} stored, {len(plan)} sent")
    await js.delete_stream(stream)
    return elapsed, cpu.client, cpu.others[0]


async def raw_read(js, names: Names, digests: list[str]) -> tuple[float, int]:
    """Direct gets of the save's chunk subjects in the order given, 32 in flight;
    nothing hashed or written."""
    todo = iter(digests)
    got = 0

    async def worker() -> None:
        nonlocal got
        for digest in todo:
            msg = await js.get_msg(names.saves_stream, subject=names.chunk(digest), direct=True)
            got += len(msg.data or b"")

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return time.perf_counter() - started, got


def tar_probe(workspace: Path, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["tar", "-cf", str(out), "-C", str(workspace), "."], check=True)
    took = time.perf_counter() - started
    out.unlink()
    return took


def hash_probe(nbytes: int = 256 * MiB) -> float:
    import hashlib

    block = os.urandom(CHUNK)
    started = time.perf_counter()
    for _ in range(nbytes // CHUNK):
        hashlib.sha256(block).hexdigest()
    return mbps(nbytes, time.perf_counter() - started)


def cut_probe(scratch: Path, nbytes: int = 256 * MiB) -> float:
    """Content-defined cutting plus sha256 of a file in the page cache, one thread:
    the work `store_capture`'s worker thread does ahead of the upload."""
    path = scratch / "cut-probe"
    path.write_bytes(os.urandom(nbytes))
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        for _ in Chunker(CHUNK).cut(fd):
            pass
        took = time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink()
    return mbps(nbytes, took)


def insertion_probe(scratch: Path, nbytes: int = 64 * MiB) -> dict[str, float]:
    """Bytes a save must send after 100 bytes are inserted in the middle of a
    file: content-defined cuts against fixed 256 KiB pieces of the same bytes."""
    import hashlib

    old = os.urandom(nbytes)
    new = old[: nbytes // 2] + os.urandom(100) + old[nbytes // 2 :]

    def cdc(data: bytes) -> dict[str, int]:
        path = scratch / "insertion-probe"
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            return {digest: len(view) for digest, view in Chunker(CHUNK).cut(fd)}
        finally:
            os.close(fd)
            path.unlink()

    def fixed(data: bytes) -> dict[str, int]:
        pieces = (data[i : i + CHUNK] for i in range(0, len(data), CHUNK))
        return {hashlib.sha256(p).hexdigest(): len(p) for p in pieces}

    sent = {}
    for name, cut in (("cdc", cdc), ("fixed", fixed)):
        before, after = cut(old), cut(new)
        sent[name] = sum(n for d, n in after.items() if d not in before)
        sent[f"{name}_chunks"] = len(after)
    return sent


async def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    files = 64 if args.quick else 256
    rounds = 1 if args.quick else 2
    increments = 3 if args.quick else 5
    total_bytes = files * FILE_BYTES
    full: list[dict] = []
    raw_up: list[tuple] = []
    fenced_up: list[float] = []
    restores: list[float] = []
    raw_reads: list[float] = []
    incs: list[dict] = []
    with temp_dir("saves") as base:
        driver = ProcessDriver(base / "host", "bench-saves")
        await driver.start()
        try:
            await driver.create_sandbox(SID, None)
            workspace = driver.workspace(SID)
            started = time.perf_counter()
            make_workspace(workspace, files)
            print(
                f"workspace: {files} × 4 MiB random in {time.perf_counter() - started:.1f}s",
                flush=True,
            )
            handle = await driver.launch(SID, "cmd-000000000000e5a7", ["sh", "-c", TICKER])
            await handle.started()
            freeze_method = driver.capabilities()["freeze"]
            plan = chunk_plan(workspace)
            time.sleep(1.1)  # nothing counts as racily clean at the first save
            with nats_server("saves") as server:
                nc = await nats.connect(
                    server.admin_url, name="bench-saves", max_reconnect_attempts=0
                )
                try:
                    js = nc.jetstream()
                    manifest = None
                    store = None
                    names = Names("bs")
                    for r in range(rounds):
                        names = Names(f"bs{r}")
                        await ensure_streams(js, names)
                        store = SaveStore(nc, names, timeout=30)
                        # Alternate which goes first so neither always gets a cold server.
                        for which in ["save", "raw"] if r % 2 == 0 else ["raw", "save"]:
                            if which == "save":
                                result = await one_save(
                                    driver, store, base / "spool", f"full-{r}", None, server.pid
                                )
                                full.append(result)
                                manifest = result["manifest_obj"]
                                print(
                                    f"round {r + 1}: full save {result['total']:.2f}s "
                                    f"(capture {result['capture']:.2f}s, upload "
                                    f"{result['upload']:.2f}s)",
                                    flush=True,
                                )
                            else:
                                raw_up.append(
                                    await raw_upload(js, f"BRAW{r}", f"braw{r}", plan, server.pid)
                                )
                                fenced_up.append(
                                    (
                                        await raw_upload(
                                            js,
                                            f"BRAWF{r}",
                                            f"brawf{r}",
                                            plan,
                                            server.pid,
                                            fence=True,
                                        )
                                    )[0]
                                )
                                print(
                                    f"round {r + 1}: raw upload {raw_up[-1][0]:.2f}s, "
                                    f"with fence headers {fenced_up[-1]:.2f}s",
                                    flush=True,
                                )
                        assert manifest is not None
                        # In the order a restore asks for them (the files' order, as
                        # stored): asked in another order, the server reads its blocks
                        # back and forth, and the baseline measures that instead.
                        digests = list(dict.fromkeys(d for e in manifest.entries for d in e.chunks))
                        for which in ["restore", "raw"] if r % 2 == 0 else ["raw", "restore"]:
                            if which == "restore":
                                dest = base / f"restored-{r}"
                                t = time.perf_counter()
                                await restore(store, manifest, dest)
                                restores.append(time.perf_counter() - t)
                                shutil.rmtree(dest)
                                print(f"round {r + 1}: restore {restores[-1]:.2f}s", flush=True)
                            else:
                                took, got = await raw_read(js, names, digests)
                                if got != manifest.total_bytes:
                                    raise RuntimeError(
                                        f"raw read {got} of {manifest.total_bytes} bytes"
                                    )
                                raw_reads.append(took)
                                print(f"round {r + 1}: raw read {took:.2f}s", flush=True)
                        if r < rounds - 1:
                            await js.delete_stream(names.saves_stream)
                    # Incremental saves on top of the last full save.
                    assert store is not None
                    for k in range(increments):
                        change_workspace(workspace, files, k)
                        time.sleep(1.1)  # a save interval: the changes are not "racy"
                        result = await one_save(
                            driver, store, base / "spool", f"inc-{k}", manifest, server.pid
                        )
                        manifest = result["manifest_obj"]
                        incs.append(result)
                        print(
                            f"incremental {k + 1}: window {ms(result['window'])} ms, "
                            f"total {ms(result['total'])} ms",
                            flush=True,
                        )
                finally:
                    await nc.close()
            tar_s = tar_probe(workspace, base / "ws.tar")
        finally:
            try:
                await driver.destroy_sandbox(SID)
                driver.cgroups.remove_host()
            finally:
                await driver.close()
        hash_mbps = hash_probe()
        cut_mbps = cut_probe(base)
        inserted = insertion_probe(base)

    # --- figures ---------------------------------------------------------------
    def col(rows: list[dict], key: str) -> float:
        return median([row[key] for row in rows])

    save_rates = [mbps(total_bytes, f["total"]) for f in full]
    raw_rates = [mbps(total_bytes, t) for t, _, _ in raw_up]
    save_ratio = median([a / b for a, b in zip(save_rates, raw_rates, strict=True)])
    restore_rates = [mbps(total_bytes, t) for t in restores]
    read_rates = [mbps(total_bytes, t) for t in raw_reads]
    restore_ratio = median([a / b for a, b in zip(restore_rates, read_rates, strict=True)])
    window_ms = max(i["window"] for i in incs) * 1000
    window_p50 = col(incs, "window") * 1000
    save_s = max(i["total"] for i in incs)
    tar_rate = mbps(total_bytes, tar_s)
    size = f"{total_bytes // MiB:,} MiB"

    inc_rows = [
        [
            str(k + 1),
            ms(i["freeze"]),
            ms(i["capture"]),
            ms(i["thaw"]),
            f"**{ms(i['window'])}**",
            ms(i["upload"]),
            ms(i["manifest"]),
            f"**{ms(i['total'])}**",
            f"{i['changed_files']} / {i['changed_bytes'] / MiB:.1f}",
            f"{i['uploaded_chunks']} / {i['uploaded_bytes'] / MiB:.1f}",
        ]
        for k, i in enumerate(incs)
    ]
    f0 = full[-1]
    full_rows = [
        [
            f"round {r + 1}",
            f"{f['freeze'] * 1000:.1f}",
            f"{f['capture']:.2f}",
            f"{f['upload']:.2f}",
            f"{f['manifest'] * 1000:.1f}",
            f"{f['total']:.2f}",
            f"{save_rates[r]:.0f}",
            f"{f['client_cpu']:.0f}% / {f['server_cpu']:.0f}%",
            f"{raw_up[r][0]:.2f}",
            f"{raw_rates[r]:.0f}",
            f"{raw_up[r][1]:.0f}% / {raw_up[r][2]:.0f}%",
        ]
        for r, f in enumerate(full)
    ]
    cdc_sent, fixed_sent = inserted["cdc"] / MiB, inserted["fixed"] / MiB
    fenced_rate = median([mbps(total_bytes, t) for t in fenced_up])
    upload_only = median([mbps(total_bytes, f["upload"]) for f in full])
    capture_only = median([mbps(total_bytes, f["capture"]) for f in full])
    body = f"""
Workspace: {files} files × 4 MiB of random data ({size}, {len(plan):,} chunks of
256 KiB) in a `ProcessDriver` sandbox (freeze method `{freeze_method}`) with a
shell loop running in it (`{TICKER}`); one nats-server (`sync_interval: always`);
SAVES stream as `ensure_streams` makes it. {rounds} round(s) of full save vs raw
upload and restore vs raw read (order alternated per round, fresh stream per
round), then {increments} incremental saves; every step in this process, no
host-agent, no services.

{
        table(
            ["", "value", "goal", "verdict"],
            [
                [
                    "freeze window, 10 MiB changed (max of runs)",
                    f"{window_ms:.1f} ms (p50 {window_p50:.1f})",
                    f"≤ {GOAL_FREEZE_MS:.0f} ms",
                    verdict(window_ms <= GOAL_FREEZE_MS),
                ],
                [
                    "save total, 10 MiB changed (max of runs)",
                    f"{save_s * 1000:.0f} ms",
                    f"≤ {GOAL_SAVE_S:.0f} s",
                    verdict(save_s <= GOAL_SAVE_S),
                ],
                [
                    "full save vs raw upload (median of ratios)",
                    f"{save_ratio:.2f}× "
                    f"({median(save_rates):.0f} vs {median(raw_rates):.0f} MiB/s)",
                    f"≥ {GOAL_RATIO}×",
                    verdict(save_ratio >= GOAL_RATIO),
                ],
                [
                    "restore vs raw direct-get read",
                    f"{restore_ratio:.2f}× "
                    f"({median(restore_rates):.0f} vs {median(read_rates):.0f} MiB/s)",
                    f"≥ {GOAL_RATIO}×",
                    verdict(restore_ratio >= GOAL_RATIO),
                ],
                [
                    "reference: `tar -cf` to local disk",
                    f"{tar_rate:.0f} MiB/s ({tar_s:.2f} s)",
                    "–",
                    "–",
                ],
            ],
        )
    }

Incremental saves (10 files with 1 MiB overwritten each, then 1.1 s — a save
interval — before the save; times in ms; freeze window = freeze + capture +
thaw; total = window + upload + manifest, as `SaveUploaded.duration_ms` +
`SaveCaptured.freeze_ms`):

{
        table(
            [
                "#",
                "freeze",
                "capture",
                "thaw",
                "window",
                "upload",
                "manifest",
                "total",
                "files / MiB read",
                "chunks / MiB sent",
            ],
            inc_rows,
        )
    }

Full (first) saves of {size} vs the raw baseline (seconds unless marked; CPU =
% of one core during the upload, this process / nats-server; {nproc()} cores):

{
        table(
            [
                "",
                "freeze ms",
                "capture",
                "upload",
                "manifest ms",
                "save total",
                "MiB/s",
                "CPU client/server",
                "raw upload",
                "raw MiB/s",
                "raw CPU client/server",
            ],
            full_rows,
        )
    }

Restore of the full save: {" / ".join(f"{t:.2f}" for t in restores)} s
({" / ".join(f"{v:.0f}" for v in restore_rates)} MiB/s); raw direct gets of the
same chunks: {" / ".join(f"{t:.2f}" for t in raw_reads)} s
({" / ".join(f"{v:.0f}" for v in read_rates)} MiB/s). Raw upload with the
headers `put_new` sends (expected subject sequence 0, msg id), same bytes:
{fenced_rate:.0f} MiB/s (median) vs {median(raw_rates):.0f} without. sha256 alone in one thread:
{hash_mbps:.0f} MiB/s; content-defined cutting plus sha256 of a file in the page
cache, one thread: {cut_mbps:.0f} MiB/s.

An insertion of 100 bytes in the middle of a 64 MiB file: the next save sends
{cdc_sent:.2f} MiB with content-defined cuts ({inserted["cdc_chunks"]} chunks in
the file) against {fixed_sent:.2f} MiB with fixed 256 KiB pieces
({inserted["fixed_chunks"]} chunks): every fixed piece after the insertion changes.

Reading: as the host-agent does it, the sandbox is frozen only for a stat walk
and a kernel-side copy (`copy_file_range`) of each changed file into the spool
(capture {capture_only:.0f} MiB/s); after the thaw `store_capture` cuts and
hashes the copies in a worker thread while the chunks already cut are being
sent ({upload_only:.0f} MiB/s with the cutting and hashing included): one pass
over the data, as the raw baseline makes. The last full save's freeze window
was {f0["window"]:.2f} s. The incremental save copies only the 10 changed files
(40 MiB: a file whose stat changed is copied whole) and sends the chunks that
differ: somewhat more than the 10 MiB overwritten, because content-defined
chunks do not line up with overwrites at 1 MiB boundaries as fixed 256 KiB
pieces do (the price of cutting by content, repaid on any insertion, above).
Restore fetches each chunk once, in the manifest's order (the raw read asks
for the same chunks in the same order, 32 in flight as the restore), and hands
it to one writer thread that hash-checks and writes it. Writing 1 GiB into the
page cache (~0.7 s of CPU) and hashing it (~0.65 s) is work the raw read does
not do, on two cores that the server and the client's message parsing keep
busy. Since decision 101 the restore's direct gets go over a connection of
their own, parsed in one loop per socket read (`bulk_get`): about a third of
nats-py's client CPU per chunk, which leaves the writer its core (before it,
the ratio varied from 0.57× to 0.76× between runs of the same code).
"""
    emit(args, "saves", "(e) Saves: freeze window, save and restore throughput", body)


if __name__ == "__main__":
    asyncio.run(main())
