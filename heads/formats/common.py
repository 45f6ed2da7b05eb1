"""Pieces every layout shares: the export error, provenance, tensor renaming, Llama config fields, atomic output."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError
from torch import Tensor

from headway.heads.files import atomic_path

PROVENANCE_FILE = "headway.json"
EMBEDDED_HUB_IDS = {"embedded:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


class ExportError(ValueError):
    """An export that cannot be written or read back; the message says what to do."""


def headway_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("headway")
    except PackageNotFoundError:
        return "unknown"


def target_hub_id(spec: dict) -> str | None:
    """The Hub id serving engines load the target from, when the recorded spec names one."""
    path = spec.get("path") or ""
    if path in EMBEDDED_HUB_IDS:
        return EMBEDDED_HUB_IDS[path]
    looks_local = path.startswith((".", "/", "~")) or path.count("/") != 1 or ":" in path
    return None if looks_local or Path(path).exists() else path


def target_reference(spec: dict, base_model: str | None = None) -> str | None:
    """What a serving engine loads the target from: `base_model` when given, else the Hub id the spec names,
    else the absolute path of a local transformers folder (config.json, no GGUF). A local path is made
    absolute so the reference still loads from another working directory. None: nothing loadable (a target
    built in code, a GGUF file), so the caller must be told `base_model=`."""
    if base_model:
        local = Path(base_model).expanduser()
        return str(local.resolve()) if local.exists() else base_model
    hub_id = target_hub_id(spec)
    if hub_id:
        return hub_id
    local = Path(spec.get("path") or "").expanduser()
    if spec.get("path") and not spec.get("gguf_file") and (local / "config.json").is_file():
        return str(local.resolve())
    return None


def is_local_path(reference: str | None) -> bool:
    return bool(reference) and reference.startswith("/")


@dataclass
class Provenance:
    """What every export records (`headway.json`) and what the reader rebuilds the head from."""

    format: str
    head_kind: str
    options: dict
    target: dict  # TargetSpec.to_dict() of the target the head was trained for
    target_shape: dict
    base_model: str | None  # the target for serving commands: Hub id or absolute local path (target_reference)
    num_speculative_tokens: int  # default draft length in the serving commands
    headway_version: str = field(default_factory=headway_version)
    source_sha256: str | None = None  # of the final/ weights the export came from
    training: dict = field(default_factory=dict)  # the run's recorded training info, if any

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Provenance":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def target_name(self) -> str:
        return self.base_model or self.target.get("name") or self.target.get("path") or "the target"

    @property
    def revision(self) -> str | None:
        return self.target.get("revision")


# ------------------------------------------------------------------------------------------ tensors

def rename(state: dict[str, Tensor], names: dict[str, str]) -> dict[str, Tensor]:
    """{new: state[old]} for names = {new: old}, as contiguous CPU tensors (safetensors wants them)."""
    return {new: state[old].detach().contiguous().cpu() for new, old in names.items()}


def check_tensors(found: dict[str, Tensor], expected: dict[str, Tensor], where: str) -> None:
    """The exact key set, shapes and dtypes a layout must have (expected = what the writer produces)."""
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ExportError(f"{where} does not hold the expected tensors: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}; re-export it with scripts/export.py")
    for key, ref in expected.items():
        if found[key].shape != ref.shape or found[key].dtype != ref.dtype:
            raise ExportError(f"{where}: tensor {key} is {found[key].dtype}{list(found[key].shape)}, "
                              f"expected {ref.dtype}{list(ref.shape)}; re-export it with scripts/export.py")


def require_zero(state: dict[str, Tensor], keys, layout: str) -> None:
    """A head tensor the layout cannot hold must be zero, or the export would change the head."""
    nonzero = [k for k in keys if bool(state[k].ne(0).any())]
    if nonzero:
        raise ExportError(f"format={layout} has no place for the nonzero tensors {nonzero}: "
                          f"the serving engines would compute a different head; use format=auto")


# ---------------------------------------------------------------------------------- Llama configs

def refuse_attention_bias(head, layout: str) -> None:
    """vLLM's and SGLang's EAGLE layers are Llama layers built bias-free from these configs: a head with
    attention biases (a Qwen2-style target) would be served without them."""
    biased = sorted(k for k in head.state_dict() if ".self_attn." in k and k.endswith(".bias"))
    if biased:
        raise ExportError(f"format={layout} cannot carry attention biases ({biased[0]}, ...): vLLM and SGLang "
                          f"build the draft layer without them; serve this head with headway's engine")


def llama_layer_fields(target_config, num_layers: int = 1) -> dict:
    """Llama config fields that size one decoder layer like the target's (what engines rebuild it from)."""
    cfg = target_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    fields = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "head_dim": head_dim,
        "hidden_act": getattr(cfg, "hidden_act", "silu"),
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": bool(getattr(cfg, "attention_bias", False)),
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
        "tie_word_embeddings": False,
        "bos_token_id": getattr(cfg, "bos_token_id", None),
        "eos_token_id": getattr(cfg, "eos_token_id", None),
        "torch_dtype": str(getattr(cfg, "dtype", None) or "float32").replace("torch.", ""),
    }
    fields.update(rope_fields(cfg))
    return fields


def rope_fields(cfg) -> dict:
    """Rope settings in both spellings: engines on transformers 4.x read rope_theta/rope_scaling, 5.x reads
    rope_parameters."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    out = {"rope_theta": theta, "rope_scaling": scaling}
    if params:
        out["rope_parameters"] = params
    return out


def require_finite(state: dict[str, Tensor], where) -> None:
    """A head with NaN or infinite weights (a diverged run, a corrupted file) must not be shipped."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise ExportError(f"{where} holds NaN or infinite weights ({', '.join(bad[:3])}): the run diverged or the "
                          f"file is corrupted; export another checkpoint (e.g. checkpoints/best/) or retrain")


# ----------------------------------------------------------------------------------- atomic output

RUN_MARKERS = ("metrics.jsonl", ".hydra", "checkpoints")  # what makes a folder a training run's directory


def run_dir_of(head_dir: Path) -> Path | None:
    """The run directory a head folder belongs to (RUN for RUN/final and RUN/checkpoints/best), if any."""
    for folder in (head_dir.parent, head_dir.parent.parent):
        if any((folder / marker).exists() for marker in RUN_MARKERS):
            return folder
    return None


def check_output_apart(output: Path, source: Path) -> None:
    """Refuse an output that is, contains or lies inside the head folder or its run directory: replacing it
    (overwrite=true) would destroy the head, its checkpoints and metrics."""
    out, src = Path(output).resolve(), Path(source).resolve()
    for protected, what in ((src, "the checkpoint folder"), (run_dir_of(src), "the checkpoint's run directory")):
        if protected is None:
            continue
        how = "is" if out == protected else "contains" if protected.is_relative_to(out) else \
            "lies inside" if out.is_relative_to(protected) else None
        if how:
            raise ExportError(f"output={output} {how} {what} {protected}: an export never writes over its source "
                              f"(whatever overwrite says); pass an output= outside {protected}")


def check_writable(folder: Path, key: str = "output") -> None:
    """Create `folder`'s parent if needed and write a probe file there: a read-only or full disk fails now,
    with one line, instead of after the slow part."""
    parent = Path(folder).absolute().parent
    existing = next(p for p in [parent, *parent.parents] if p.exists())
    if not existing.is_dir():
        raise ExportError(f"cannot write {key}={folder}: {existing} is a file, not a folder; choose another {key}=")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{Path(folder).name}.probe-") as probe:
            probe.write(b"headway")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise ExportError(f"cannot write {key}={folder}: {exc.strerror or exc} ({exc.filename or parent}); "
                          f"choose a writable {key}= on a disk with free space") from None


def check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ExportError(f"output={output} is a file: pass a directory path")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ExportError(f"output={output} exists and is not empty: pass overwrite=true or another output=")


def write_atomically(output: Path, fill: Callable[[Path], None], overwrite: bool) -> Path:
    """Build the export in a temp folder next to `output`, then swap it in: a failure leaves `output` as it was."""
    output = Path(output)
    check_output(output, overwrite)
    try:
        with atomic_path(output, directory=True) as tmp:
            fill(tmp)
    except (OSError, SafetensorError) as exc:  # a full disk midway: the temp folder goes, `output` stays
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
        raise ExportError(f"cannot write output={output}: {reason}; free some space or choose another "
                          f"output=") from None
    return output


def save_tensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ExportError(f"{path} is missing: re-export the head")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ExportError(f"{path} is corrupted or unreadable ({exc}): re-export the head") from exc

