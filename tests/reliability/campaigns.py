"""Fault campaigns run in their own process: ``python -m tests.reliability.campaigns NAME ...``.

Each prints one JSON object of counts on stdout. They run apart from pytest so that forking,
rlimits and kills never touch the test process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP = ".ckptkit-tmp"


def _temps(folder: Path) -> int:
    return sum(1 for p in folder.iterdir() if p.name.endswith(TMP))


def _payload(version: int, mb: int) -> dict[str, Any]:
    import torch

    return {"version": torch.tensor(version), "data": torch.full((mb * 262144,), float(version))}


def _consistent(obj: dict[str, Any]) -> int:
    """The version a loaded payload claims, or -1 if its data disagrees (a torn or mixed file)."""
    import torch

    v = int(obj["version"])
    return v if bool(torch.all(obj["data"] == float(v))) else -1


def _kill_writer(
    write_forever: Any, folder: Path, rng: random.Random, max_delay: float, counts: dict[str, Any]
) -> None:
    """Fork a child running ``write_forever()``, SIGKILL it after a random delay, count the kill."""
    pid = os.fork()
    if pid == 0:  # the writer: never returns
        write_forever()
        os._exit(0)
    time.sleep(rng.uniform(0.0, max_delay))
    mid = _temps(folder) > 0
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    counts["trials"] += 1
    counts["killed_mid_write"] += int(mid)
    counts["max_temps"] = max(counts["max_temps"], _temps(folder))


def kill_save(trials: int, folder: Path, seed: int, mb: int = 4) -> dict[str, Any]:
    """Fork writers that save_on_master in a loop; SIGKILL each at a random moment."""
    import torch

    import ckptkit

    torch.set_num_threads(1)  # no intra-op thread pool to inherit across fork()
    rng = random.Random(seed)
    path = folder / "ckpt.pt"
    ckptkit.save_on_master(_payload(0, mb), path)
    last, counts = 0, {"trials": 0, "killed_mid_write": 0, "torn": 0, "unreadable": 0, "went_back": 0, "max_temps": 0}
    for _ in range(trials):

        def write_forever(v: int = last + 1) -> None:
            while True:
                ckptkit.save_on_master(_payload(v, mb), path)
                v += 1

        _kill_writer(write_forever, folder, rng, 0.06, counts)
        try:
            v = _consistent(ckptkit.read_checkpoint(path))
        except ckptkit.CkptkitError:
            counts["unreadable"] += 1
            continue
        if v < 0:
            counts["torn"] += 1
        elif v < last:
            counts["went_back"] += 1
        else:
            last = v
    ckptkit.save_on_master(_payload(last + 1, mb), path)  # the next writer clears any debris
    counts["temps_after"] = _temps(folder)
    counts["final_loads"] = int(_consistent(ckptkit.read_checkpoint(path)) == last + 1)
    return counts


def kill_convert(trials: int, folder: Path, seed: int, mb: int = 8) -> dict[str, Any]:
    """Fork converters that rewrite one DST from two alternating sources; SIGKILL at random."""
    import torch

    import ckptkit

    torch.set_num_threads(1)
    rng = random.Random(seed)
    sources = []
    for v in (1, 2):
        src = folder / f"ddp_{v}.pt"
        torch.save({f"module.layer{i}.weight": torch.full((mb * 262144 // 8,), float(v)) for i in range(8)}, src)
        sources.append(src)
    dst = folder / "single.safetensors"
    ckptkit.convert_checkpoint(sources[0], dst)
    counts = {"trials": 0, "killed_mid_write": 0, "torn": 0, "unreadable": 0, "max_temps": 0}

    def convert_forever() -> None:
        i = 0
        while True:
            ckptkit.convert_checkpoint(sources[i % 2], dst, force=True)
            i += 1

    for _ in range(trials):
        _kill_writer(convert_forever, folder, rng, 0.05, counts)
        try:
            out = ckptkit.read_checkpoint(dst)
        except ckptkit.CkptkitError:
            counts["unreadable"] += 1
            continue
        values = {float(t[0]) for t in out.values()}
        whole = len(out) == 8 and len(values) == 1 and all(bool(torch.all(t == t[0])) for t in out.values())
        counts["torn"] += int(not whole or not ckptkit.verify_checkpoint(dst).ok)
    ckptkit.convert_checkpoint(sources[0], dst, force=True)
    counts["temps_after"] = _temps(folder)
    return counts


def _fault_case(name: str, folder: Path, prepare: Any, cleanup: Any = None) -> list[dict[str, Any]]:
    """Under a fault, save over a good checkpoint and convert over a good output: report the
    error, whether the old file survived, and any debris."""
    import torch

    import ckptkit

    src = folder.parent / f"src-{folder.name}.pt"
    torch.save({f"module.w{i}": torch.full((262144,), float(i)) for i in range(4)}, src)  # 4 MiB
    results = []
    for action in ("save_on_master", "convert", "convert to DCP"):
        path = (
            folder / {"save_on_master": "ckpt.pt", "convert": "single.safetensors", "convert to DCP": "out.dcp"}[action]
        )
        if action == "save_on_master":
            ckptkit.save_on_master(_payload(1, 1), path)
        elif action == "convert":
            path.write_bytes(b"the previous output")
        else:  # a DCP folder written before, which the failed convert must leave as it was
            small = folder.parent / f"small-{folder.name}.pt"
            torch.save({"module.w": torch.ones(4)}, small)
            ckptkit.convert_checkpoint(small, path, format="dcp")
        before = _contents(path)
        result: dict[str, Any] = {"case": name, "action": action}
        try:
            prepare()
            try:
                if action == "save_on_master":
                    ckptkit.save_on_master(_payload(2, 4), path)  # 4 MiB: bigger than every limit used
                elif action == "convert":
                    ckptkit.convert_checkpoint(src, path, force=True)
                else:
                    ckptkit.convert_checkpoint(src, path, force=True, format="dcp")
                result["error"] = None
            except ckptkit.CkptkitError as e:
                result["error"] = f"{type(e).__name__}: {e}"
        finally:
            if cleanup is not None:
                cleanup()
        result["old_intact"] = _contents(path) == before
        result["temps"] = _temps(folder)
        results.append(result)
    return results


def _contents(path: Path) -> dict[str, bytes]:
    """A file's bytes, or a folder's files and their bytes."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return {"": path.read_bytes()}


def disk_faults(trials: int, folder: Path, seed: int) -> dict[str, Any]:
    """File too large (RLIMIT_FSIZE), disk full (2 MiB tmpfs), a read-only filesystem (a tmpfs
    remounted ro), permission denied (chattr +i): each under save_on_master, convert and convert to DCP."""
    import resource
    import subprocess

    cases = []
    # RLIMIT_FSIZE: the kernel sends SIGXFSZ (fatal by default); a process that ignores it gets EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    big = folder / "fsize"
    big.mkdir()
    cases.extend(
        _fault_case(
            "file too large (RLIMIT_FSIZE 2 MiB)",
            big,
            lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, hard)),
            lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard)),
        )
    )
    full = folder / "tmpfs"
    full.mkdir()
    mounted = (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(full)], capture_output=True).returncode
        == 0
    )
    if mounted:
        try:
            cases.extend(_fault_case("disk full (2 MiB tmpfs)", full, lambda: None))
        finally:
            subprocess.run(["umount", str(full)], check=False)
    else:
        cases.append({"case": "disk full (tmpfs)", "skipped": "mount not permitted here"})
    readonly = folder / "readonly"
    readonly.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(readonly)], capture_output=True
        ).returncode
        == 0
    ):

        def remount(mode: str) -> None:
            subprocess.run(["mount", "-o", f"remount,{mode}", str(readonly)], check=True, capture_output=True)

        try:
            cases.extend(
                _fault_case(
                    "read-only filesystem (tmpfs remounted ro)", readonly, lambda: remount("ro"), lambda: remount("rw")
                )
            )
        finally:
            subprocess.run(["umount", str(readonly)], check=False)
    else:
        cases.append({"case": "read-only filesystem (tmpfs)", "skipped": "mount not permitted here"})
    locked = folder / "immutable"
    locked.mkdir()

    def lock() -> None:
        subprocess.run(["chattr", "+i", str(locked)], check=True, capture_output=True)

    def unlock() -> None:
        subprocess.run(["chattr", "-i", str(locked)], check=False, capture_output=True)

    if subprocess.run(["chattr", "-i", str(locked)], capture_output=True).returncode == 0:
        cases.extend(_fault_case("permission denied (chattr +i folder)", locked, lock, unlock))
    else:
        cases.append({"case": "permission denied (chattr)", "skipped": "chattr not available here"})
    return {"cases": cases}


def read_while_rewriting(trials: int, folder: Path, seed: int) -> dict[str, Any]:
    """A forked writer replaces the file over and over; every read must be one whole version,
    and every convert of it must write one whole version (values and checksums)."""
    import torch

    import ckptkit

    torch.set_num_threads(1)
    counts = {"reads": 0, "mixed": 0, "unreadable": 0, "versions_seen": 0, "converts": 0, "mixed_converts": 0}
    for suffix in (".pt", ".safetensors"):
        path = folder / f"hot{suffix}"
        ckptkit.write_checkpoint(_payload(0, 4), path)
        pid = os.fork()
        if pid == 0:
            v = 1
            while True:
                ckptkit.write_checkpoint(_payload(v, 4), path)
                v += 1
        seen = set()
        try:
            for _ in range(trials):
                try:
                    v = _consistent(ckptkit.read_checkpoint(path))
                except ckptkit.CkptkitError:
                    counts["unreadable"] += 1
                    continue
                counts["reads"] += 1
                counts["mixed"] += int(v < 0)
                seen.add(v)
                if counts["reads"] % 4 == 0:  # a converted copy, made while the source is replaced
                    out = folder / f"converted{suffix}"
                    ckptkit.convert_checkpoint(path, out, force=True)
                    whole = ckptkit.verify_checkpoint(out).ok and _consistent(ckptkit.read_checkpoint(out)) >= 0
                    counts["converts"] += 1
                    counts["mixed_converts"] += int(not whole)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        counts["versions_seen"] += len(seen)
    return counts


def hostile_inputs(trials: int, folder: Path, seed: int) -> dict[str, Any]:
    """Every hostile input through every reader, under a 6 GiB address-space limit."""
    import resource

    import torch

    import ckptkit
    from tests.reliability import hostile

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    torch.set_num_threads(1)
    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    work = folder / "inputs"
    work.mkdir(exist_ok=True)
    out_dir = folder / "out"
    out_dir.mkdir(exist_ok=True)
    counts: dict[str, Any] = {
        "inputs": 0,
        "families": {},
        "findings": [],
        "cli_exit_codes": {},
        "payload_flips": 0,
        "payload_flips_caught_by_verify": 0,
    }
    for family, what, path in hostile.corpus(fixtures, work, seed, max(1, trials)):
        counts["inputs"] += 1
        counts["families"][family] = counts["families"].get(family, 0) + 1
        out = out_dir / "out.pt"
        found = hostile.check_library(path, out_dir / "lib_out.pt")
        cli_found, codes = hostile.check_cli(path, out)
        for k, v in codes.items():
            counts["cli_exit_codes"][k] = counts["cli_exit_codes"].get(k, 0) + v
        counts["findings"] += [f"{family} / {what}: {f}" for f in found + cli_found]
        if family == "bit flip in payload":
            counts["payload_flips"] += 1
            counts["payload_flips_caught_by_verify"] += int(not ckptkit.verify_checkpoint(path).ok)
    return counts


def code_payloads(trials: int, folder: Path, seed: int) -> dict[str, Any]:
    """Pickles that try to run code, through every reader; the marker file must never appear."""
    import ckptkit
    from tests.reliability import payloads

    marker = folder / "PAYLOAD_RAN"
    inputs = list(payloads.files(folder, marker))
    readers = payloads.readers(folder / "out.pt")
    counts: dict[str, Any] = {
        "payload_files": len(inputs),
        "readers": len(readers),
        "runs": 0,
        "executed": 0,
        "refused": 0,
        "findings": [],
    }
    for desc, path in inputs:
        for rname, read in readers.items():
            marker.unlink(missing_ok=True)
            outcome = "returned"
            try:
                result = read(path)
                if rname == "verify_checkpoint" and result.ok:
                    outcome = "verified as fine"
                if rname == "inspect_checkpoint" and result.needs_trust:
                    outcome = "refused"  # a summary that names the globals instead of loading them
            except ckptkit.errors.UnsafeCheckpointError:
                outcome = "refused"
            except ckptkit.CkptkitError as e:
                outcome = f"{type(e).__name__}"
            except AssertionError as e:  # a CLI command did not exit 1
                outcome = f"cli: {e}"
            counts["runs"] += 1
            if marker.exists():
                counts["executed"] += 1
                counts["findings"].append(f"{desc} / {rname}: PAYLOAD RAN")
            if (
                outcome == "refused"
                or (rname == "verify_checkpoint" and outcome == "returned")
                or rname.startswith("cli")
            ):
                counts["refused"] += int(outcome in ("refused", "returned"))
            else:
                counts["findings"].append(f"{desc} / {rname}: {outcome}")
    # The control: trusting the file does run the payload, so the marker check above can fail.
    marker.unlink(missing_ok=True)
    ckptkit.read_checkpoint(inputs[0][1], trust=True)
    counts["control_ran_when_trusted"] = marker.exists()
    return counts


def fuzz(trials: int, folder: Path, seed: int) -> dict[str, Any]:
    """hypothesis over the readers: mutated fixtures and generated safetensors headers.

    Any input that makes a reader raise something other than a CkptkitError is saved under
    ``folder/findings`` (to become a regression fixture) and reported.
    """
    import resource

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.reliability import hostile

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    fixtures = Path(__file__).resolve().parents[2] / "fixtures"
    bases = {name: (fixtures / name).read_bytes() for name in hostile.BASES}
    found_dir = folder / "findings"
    found_dir.mkdir(exist_ok=True)
    counts: dict[str, Any] = {"examples": 0, "findings": []}
    mutation = st.one_of(
        st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
        st.tuples(st.just("set"), st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
        st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True), st.just(0)),
        st.tuples(st.just("insert"), st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), st.floats(0, 1, exclude_max=True), st.integers(1, 64)),
    )

    def mutate(data: bytes, ops: list[tuple[str, float, Any]]) -> bytes:
        buf = bytearray(data)
        for kind, where, arg in ops:
            if not buf:
                break
            i = int(where * len(buf))
            if kind == "flip":
                buf[i] ^= 1 << arg
            elif kind == "set":
                buf[i] = arg
            elif kind == "truncate":
                del buf[i:]
            elif kind == "insert":
                buf[i:i] = arg
            else:
                del buf[i : i + arg]
        return bytes(buf)

    def run(name: str, data: bytes) -> None:
        counts["examples"] += 1
        path = folder / f"input{Path(name).suffix}"
        path.write_bytes(data)
        problems = hostile.check_library(path, folder / "out.pt")
        if problems:
            keep = found_dir / f"finding{len(counts['findings']):03d}{Path(name).suffix}"
            keep.write_bytes(data)
            counts["findings"].append(f"{keep.name} (from {name}): {problems[0]}")

    # seed 0: the same examples every run (CI); any other seed explores new ones.
    options = settings(
        max_examples=trials,
        deadline=None,
        derandomize=seed == 0,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    @options
    @given(st.sampled_from(sorted(bases)), st.lists(mutation, min_size=1, max_size=4))
    def mutated(name: str, ops: list[tuple[str, float, Any]]) -> None:
        run(name, mutate(bases[name], ops))

    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8))
    entry = st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X9", ""]),
            "shape": st.lists(st.integers(-2, 2**41), max_size=3),
            "data_offsets": st.lists(st.integers(-8, 2**41), min_size=0, max_size=3),
        }
    )
    header = st.dictionaries(st.text(min_size=1, max_size=6), st.one_of(entry, json_leaf), max_size=4)

    @options
    @given(header, st.binary(max_size=64), st.one_of(st.none(), st.integers(0, 2**64 - 1)))
    def safetensors_header(h: dict[str, Any], data: bytes, length: int | None) -> None:
        run("generated.safetensors", hostile._st(h, data, length=length))

    from hypothesis import seed as hypothesis_seed

    for test in (mutated, safetensors_header):
        (hypothesis_seed(seed)(test) if seed else test)()
    return counts


_WRITER = """
import json, sys, pathlib, torch, ckptkit
where, start, steps, status, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4]), int(sys.argv[5])
if len(sys.argv) > 6:  # an object store: multipart uploads of 5 MiB parts (S3's least)
    from ckptkit.io import remote
    remote.PART_SIZE = 5 << 20
torch.set_num_threads(1)
committed = 0
try:
    folder = ckptkit.CheckpointFolder(where, keep=2)
    for step in range(start, start + steps):
        path = folder.path_for(step)
        ckptkit.save_on_master({"step": torch.tensor(step), "w": torch.full((mb << 18,), float(step))}, path)
        folder.commit(path)
        committed += 1
        status.write_text(json.dumps({"committed": committed, "step": step}))
    outcome = {"how": "done"}
except ckptkit.CkptkitError as e:
    outcome = {"how": "refused" if committed == 0 else "failed", "error": f"{type(e).__name__}: {e}"}
except Exception as e:
    outcome = {"how": "crashed", "error": f"{type(e).__name__}: {e}"}
status.write_text(json.dumps({"committed": committed, **outcome}))
"""


def _writer(where: str, start: int, steps: int, status: Path, mb: int, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _WRITER, where, str(start), str(steps), str(status), str(mb), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _status(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return {}


def _consistent_at(path: Any) -> bool:
    """A checkpoint's values are those of the step its name says."""
    import ckptkit

    obj = ckptkit.read_checkpoint(path)
    step = int(obj["step"])
    return bool((obj["w"] == float(step)).all()) and f"step_{step:09d}" in str(path)


def concurrent_writers(trials: int, folder: Path, seed: int) -> dict[str, Any]:
    """Two writers on one CheckpointFolder, as when an old SLURM job still runs as its requeued copy
    starts: the second, started once the first has committed, resumes from ``latest``. A reader
    polls the folder all the while. The second writer must be refused at once (naming the first);
    nothing either commits may be lost, and ``latest`` must always name a loadable checkpoint."""
    import ckptkit

    rng = random.Random(seed)
    counts = {
        "trials": 0,
        "second writer refused at once": 0,
        "both writers wrote": 0,
        "a writer lost its checkpoint or died": 0,
        "latest named a missing file": 0,
        "reader could not open the latest checkpoint": 0,
        "reads": 0,
        "final latest not loadable": 0,
        "errors": [],
    }
    for trial in range(trials):
        at = folder / f"run{trial}"
        first = _writer(str(at), 1, 10**6, folder / f"a{trial}.json", 1)  # the old job: runs until stopped
        while _status(folder / f"a{trial}.json").get("committed", 0) < rng.randint(1, 5) and first.poll() is None:
            time.sleep(0.01)
        latest_step = _status(folder / f"a{trial}.json").get("step", 0)
        second = _writer(str(at), latest_step + 1, 30, folder / f"b{trial}.json", 1)
        probe = ckptkit.CheckpointFolder(at)  # reads only: no path_for, no commit
        while second.poll() is None:
            pointer = at / "latest"
            try:
                name = pointer.read_text().strip()
                if name and not (at / name).exists() and pointer.read_text().strip() == name:  # still named
                    counts["latest named a missing file"] += 1
            except FileNotFoundError:
                pass
            try:
                with _opened_latest(probe) as path:
                    if path is not None:
                        counts["reads"] += 1
                        if not _consistent_at(path):
                            counts["reader could not open the latest checkpoint"] += 1
            except ckptkit.CkptkitError as e:
                counts["reader could not open the latest checkpoint"] += 1
                counts["errors"].append(f"reader: {type(e).__name__}: {e}"[:300])
            time.sleep(0.005)
        first.kill()  # the old job ends as SLURM ends it when its time is up
        first.wait()
        outcomes = [
            _status(folder / f"{w}{trial}.json") | {"stderr": p.stderr.read()[-300:] if p.stderr else ""}
            for w, p in (("a", first), ("b", second))
        ]
        if "how" not in outcomes[0]:
            outcomes[0]["how"] = "done"  # still writing when killed: it lost nothing it had committed
        counts["trials"] += 1
        b = outcomes[1]
        if b.get("how") == "refused":
            counts["second writer refused at once"] += 1
            counts.setdefault("refusal", b.get("error", ""))
        elif b.get("committed", 0) > 0:
            counts["both writers wrote"] += 1
        for o in outcomes:
            if o.get("how") not in ("done", "refused"):
                counts["a writer lost its checkpoint or died"] += 1
                counts["errors"].append(f"writer: {o}"[:400])
        try:
            final = ckptkit.CheckpointFolder(at).latest()
            counts["final latest not loadable"] += int(final is None or not _consistent_at(final))
        except ckptkit.CkptkitError as e:
            counts["final latest not loadable"] += 1
            counts["errors"].append(f"final: {type(e).__name__}: {e}"[:300])
    return counts


@contextlib.contextmanager
def _opened_latest(folder: Any) -> Iterator[Any]:
    """The latest checkpoint, held open where the folder offers that (``open_latest``), else named."""
    if hasattr(folder, "open_latest"):
        with folder.open_latest() as path:
            yield path
    else:
        yield folder.latest()


_PART_DELAY_S = 0.3


def _slow_parts_server(port: int) -> Any:
    """moto's ThreadedMotoServer on ``port``, each part upload held ``_PART_DELAY_S`` as a store
    across a network would: on the local server a 12 MiB upload is over in a few milliseconds, too
    short a window to kill a writer in."""
    from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)

    def serve(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in environ.get("QUERY_STRING", ""):
            time.sleep(_PART_DELAY_S)
        return app(environ, start_response)

    class Server(ThreadedMotoServer):  # type: ignore[misc]
        def _server_entry(self) -> None:  # moto's own, with serve in front of its app
            self._server = make_server(self._ip_address, self._port, serve, True)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server(ip_address="127.0.0.1", port=port, verbose=False)


def _open_uploads(client: Any) -> set[str]:
    return {u["UploadId"] for u in client.list_multipart_uploads(Bucket="ckptkit-campaign").get("Uploads", [])}


def kill_s3(trials: int, folder: Path, seed: int) -> dict[str, Any]:
    """kill -9 a writer saving 12 MiB checkpoints to a CheckpointFolder on S3 (moto), at random
    moments during its multipart uploads. Nothing committed may be lost or torn; killed writers'
    staging folders must not pile up, and their multipart uploads are counted."""
    import logging
    import socket

    import boto3

    import ckptkit

    rng = random.Random(seed)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = _slow_parts_server(port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    staging = folder / "staging"
    staging.mkdir()
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        CKPTKIT_STAGING=str(staging),
    )
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="ckptkit-campaign")
    url = "s3://ckptkit-campaign/run"
    counts: dict[str, Any] = {
        "trials": 0,
        "killed mid-upload": 0,
        "torn": 0,
        "unreadable": 0,
        "went_back": 0,
        "errors": [],
    }
    last = 0
    try:
        for trial in range(trials):
            status = folder / f"w{trial}.json"
            proc = _writer(url, last + 1, 1000, status, 12, "s3")
            while _status(status).get("committed", 0) < 1 and proc.poll() is None:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.5))
            # Then wait for an upload to start and kill at once (even trials) or a little later,
            # perhaps after its part or its commit (odd trials): each part takes _PART_DELAY_S.
            seen = _open_uploads(client)
            while not seen and proc.poll() is None:
                time.sleep(0.005)
                seen = _open_uploads(client)
            time.sleep(0.0 if trial % 2 == 0 else rng.uniform(0.0, 2 * _PART_DELAY_S))
            proc.kill()
            proc.wait()
            counts["trials"] += 1
            # A kill landed mid-upload exactly when the upload seen is still open: a live writer
            # completes or aborts it, a killed one can do neither.
            counts["killed mid-upload"] += int(bool(seen & _open_uploads(client)))
            if proc.returncode != -signal.SIGKILL:
                counts["errors"].append(
                    f"writer ended before the kill: {_status(status)} {proc.stderr.read()[-300:] if proc.stderr else ''}"
                )
            try:
                latest = ckptkit.CheckpointFolder(url).latest()
                if latest is None or not _consistent_at(latest):
                    counts["torn"] += 1
                else:
                    step = int(str(latest).rsplit("step_", 1)[1].split(".")[0])
                    counts["went_back"] += int(step < last)
                    last = max(last, step)
            except ckptkit.CkptkitError as e:
                counts["unreadable"] += 1
                counts["errors"].append(f"{type(e).__name__}: {e}"[:300])
        counts["staging folders left by the killed writers"] = len(list(staging.iterdir()))
        counts["multipart uploads left by the killed writers"] = len(
            client.list_multipart_uploads(Bucket="ckptkit-campaign").get("Uploads", [])
        )
        # One more writer, left to finish: what it cleans on its way is what stays bounded.
        proc = _writer(url, last + 1, 1, folder / "final.json", 12, "s3")
        proc.wait()
        counts["final writer"] = _status(folder / "final.json").get("how")
        counts["staging folders left after the next writer"] = len(list(staging.iterdir()))
        counts["multipart uploads left after the next writer"] = len(
            client.list_multipart_uploads(Bucket="ckptkit-campaign").get("Uploads", [])
        )
    finally:
        server.stop()
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("campaign")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    fn = {
        "kill-save": kill_save,
        "kill-convert": kill_convert,
        "disk-faults": disk_faults,
        "read-while-rewriting": read_while_rewriting,
        "hostile-inputs": hostile_inputs,
        "code-payloads": code_payloads,
        "fuzz": fuzz,
        "concurrent-writers": concurrent_writers,
        "kill-s3": kill_s3,
    }[args.campaign]
    print(json.dumps(fn(args.trials, args.dir, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
