"""cbserve offline for benchmarks/bench_serving.py: ``cbserve.LLM`` on a burst's requests, in a child process (its
own threads and memory, nothing of a server left running next to it), with the served requests' sampling.

The child is this file run as a script: ``serving_offline.py REQUESTS_JSON OUT_JSON ENGINE_KWARGS SAMPLING``."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cbserve.bench.datasets import SampleRequest


def offline_sampling(sampling: dict[str, float], max_tokens: int) -> Any:
    """The offline run's SamplingParams for one request: the served requests' sampling."""
    from cbserve import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)


def run_offline(reqs: list[SampleRequest], engine_kwargs: str, sampling: dict[str, float],
                timeout_s: float) -> dict[str, Any]:
    """One burst of ``reqs`` through ``cbserve.LLM(**engine_kwargs)`` in a child process: its summary (output
    tok/s over the generate call, after one warm-up request; ``cpu_s``, the CPU seconds the call took), or
    ``{"skipped": why}``."""
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        req_file, out_file = Path(tmp) / "requests.json", Path(tmp) / "offline.json"
        req_file.write_text(json.dumps([asdict(r) for r in reqs]))
        cmd = [sys.executable, __file__, str(req_file), str(out_file), engine_kwargs, json.dumps(sampling)]
        r = subprocess.run(cmd, timeout=timeout_s)
        if r.returncode != 0 or not out_file.exists():
            return {"skipped": f"offline run failed (exit {r.returncode})"}
        return json.loads(out_file.read_text())


def offline_summary(reqs: list[SampleRequest], engine_kwargs: dict[str, Any], sampling: dict[str, float]) -> dict:
    """``reqs`` through ``cbserve.LLM(**engine_kwargs)`` in this process, after one warm-up request: the burst's
    summary (``offline_burst``)."""
    from cbserve import LLM, SamplingParams

    llm = LLM(**{"progress": False, **engine_kwargs})
    llm.generate([reqs[0].prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    summary = offline_burst(llm, reqs, sampling)
    llm.shutdown()
    return {**summary, "engine_kwargs": engine_kwargs}


def offline_burst(llm: Any, reqs: list[SampleRequest], sampling: dict[str, float]) -> dict:
    """One burst of ``reqs`` through a warm ``llm``: output tok/s over the generate call; ``cpu_s``, the
    process's CPU seconds during it."""
    params = [offline_sampling(sampling, r.output_len) for r in reqs]
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
    dur, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "duration_s": dur, "num_requests": len(reqs), "completed": len(outs), "failed": 0,
        "total_input_tokens": n_in, "total_output_tokens": n_out, "output_throughput": n_out / dur,
        "request_throughput": len(outs) / dur, "total_token_throughput": (n_in + n_out) / dur, "cpu_s": cpu_s,
    }


def offline_worker(req_file: str, out_file: str, kwargs_json: str, sampling_json: str) -> int:
    reqs = [SampleRequest(**d) for d in json.loads(Path(req_file).read_text())]
    summary = offline_summary(reqs, json.loads(kwargs_json), json.loads(sampling_json))
    Path(out_file).write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(offline_worker(*sys.argv[1:5]))
