"""The one interface every draft head implements, used alike by train/, infer/ and export.

A head knows how to (1) build itself from the target's config, (2) say which target features it needs and
compute its training loss from them, (3) save/load itself as a self-describing folder, and (4) propose
draft tokens at inference through `draft_begin` / `draft_expand` / `draft_end`. train/ and infer/ never
branch on a head's kind: adding a head means one new file in heads/ (decorated with `@register_head`) and
one YAML in conf/head/.

Conventions
-----------
* Target features (`TargetFeatures.hidden_states`) are indexed like transformers' `output_hidden_states`:
  index 0 is the embedding output, index i < N is the *input* of decoder layer i, index N (= num layers)
  is the final-normed last hidden state, i.e. exactly what the LM head reads (EAGLE's feature f).
* The feature at position t summarises x_0..x_t and predicts x_{t+1}.
* `loss_mask[b, t]` is True where token t is a target to learn (an assistant token). A head predicting
  x_{t+k} from position t is trained where `loss_mask[:, t+k]` is True.
* Frozen target pieces (embedding, final norm, LM head, rotary embedding) are *borrowed*, not owned: they
  are kept outside the module tree (`self.frozen`), so they never reach the optimizer, DDP/DeepSpeed or
  the head's checkpoint. The checkpoint records the target's spec instead.
"""

from __future__ import annotations

import json
import os
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from headway.heads.files import atomic_path
from headway.heads.kernels.gemm import many_rows
from headway.heads.target import Target, TargetError, TargetSpec, target_parts

HEAD_REGISTRY: dict[str, type["DraftHead"]] = {}
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
COUNTS_NAME = "token_counts.safetensors"  # training token frequencies: the inference draft vocabulary
FORMAT_VERSION = 1


def register_head(kind: str):
    """Class decorator: make a head available by name (`head=<kind>`); a kind names one head only."""

    def wrap(cls):
        if HEAD_REGISTRY.get(kind, cls) is not cls:
            raise HeadError(f"head kind {kind!r} is already registered by {HEAD_REGISTRY[kind].__module__}."
                            f"{HEAD_REGISTRY[kind].__qualname__}: give {cls.__qualname__} another kind")
        cls.kind = kind
        HEAD_REGISTRY[kind] = cls
        return cls

    return wrap


class HeadError(ValueError):
    """Bad head options or a checkpoint that does not fit; the message says what to do."""


# ------------------------------------------------------------------------------------------ features

@dataclass
class TargetFeatures:
    """The frozen target's view of a batch of sequences [B, T]."""

    hidden_states: dict[int, Tensor]  # hidden_states index -> [B, T, h]; see module docstring
    num_layers: int  # N: hidden_states[N] is the final-normed last hidden state
    logits: Tensor | None = None  # [B, T, V] target logits, if computed (else heads use lm_head)

    @property
    def last_hidden(self) -> Tensor:  # [B, T, h]
        return self.hidden_states[self.num_layers]

    def slice(self, index) -> "TargetFeatures":
        """Select along the time axis (e.g. `slice(np.s_[:, -3:])`) for every stored tensor."""
        return TargetFeatures({k: v[index] for k, v in self.hidden_states.items()}, self.num_layers,
                              None if self.logits is None else self.logits[index])


@torch.no_grad()
def compute_features(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                     layers: list[int], with_logits: bool = False) -> TargetFeatures:
    """Run the frozen target once and keep only the hidden states a head asks for (whole sequences: the
    machine's faster many-row GEMM, heads/kernels/gemm.py)."""
    num_layers = model.config.num_hidden_layers
    check_layer_ids(layers, num_layers)
    with many_rows(model):
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                    use_cache=False, logits_to_keep=0 if with_logits else 1)
    hidden = {i: out.hidden_states[i] for i in sorted(set(layers) | {num_layers})}
    return TargetFeatures(hidden, num_layers, out.logits.float() if with_logits else None)


def check_layer_ids(layers, num_layers: int) -> None:
    bad = [i for i in layers if not 0 <= int(i) <= num_layers]
    if bad:
        raise HeadError(f"layer ids {bad} are out of range for a target with {num_layers} layers: "
                        f"use hidden-state indices in [0, {num_layers}]")


# ---------------------------------------------------------------------------------------------- loss

@dataclass
class HeadLoss:
    loss: Tensor  # scalar, differentiable
    depth_correct: Tensor  # [K] number of positions whose depth-k draft (top-1) equals the label
    depth_count: Tensor  # [K] number of positions scored at depth k (accuracy = correct / count)
    metrics: dict[str, float] = field(default_factory=dict)  # extra scalars to log (already .item()-ed)


def simulated_tau(depth_acc) -> float:
    """tau = 1 + sum_k prod_{j<=k} a_j: expected tokens per verification of a chain whose depth-k draft is
    accepted with probability a_k once depth k-1 was (Leviathan et al. 2023, with per-depth rates)."""
    tau, run = 1.0, 1.0
    for a in depth_acc:
        run *= float(a)
        tau += run
    return tau


# ---------------------------------------------------------------------------------------------- head

class DraftHead(nn.Module, metaclass=ABCMeta):
    """What every draft head is: the methods train/ and infer/ call, abstract where each head differs.

    A subclass is registered by `@register_head(kind)` (which sets `kind`) and implements the abstract
    methods below; the others have defaults it may override. All tensors live on the head's device.

    Inference: the committed sequence is x_0..x_m; the target's features are known at positions < m (the
    newest token x_m, e.g. the bonus token, has no feature yet). One draft round is `draft_begin` (new
    committed context), then `draft_expand` once per tree level, then `draft_end`.

    Draft vocabulary (inference only): `set_draft_vocab(k)` makes every draft read-out (`readout`) score
    only the k most frequent training tokens (`token_counts`, saved beside the weights), so a draft step
    reads k rows of the [V, h] read-out matrix instead of V; other tokens get -inf (never proposed;
    verification stays lossless since the verifier only needs *some* proposal). Training never restricts.
    """

    kind: ClassVar[str] = ""

    def __init__(self, target_config, **options):
        """Build parameters from the target's HF config and the head's options (conf/head/<kind>.yaml)."""
        super().__init__()
        self.target_config = target_config
        self.options = dict(options)
        self.target_spec: TargetSpec | None = None
        object.__setattr__(self, "frozen", {})  # borrowed target modules: never registered, never saved
        self.token_counts: Tensor | None = None  # [V] loss-masked training token frequencies
        self.draft_vocab: Tensor | None = None  # [k] ascending target ids drafts may use (None: all)
        self.acceptance: list[float] = []  # per-depth top-1 acceptance measured at its last validation
        # read-out matrix id -> (its rows for draft_vocab, their slots); "train" -> the frozen read-out's training rows
        object.__setattr__(self, "_rows", {})
        self._train_ids: Tensor | None = None  # [Vt] ascending target ids the training read-out scores

    # ------------------------------------------------------------------- what each head implements
    @abstractmethod
    def forward(self, input_ids: Tensor, loss_mask: Tensor, feats: TargetFeatures) -> HeadLoss:
        """The training loss of input_ids [B, T] where loss_mask [B, T] (bool) marks tokens to learn.
        Call it through the (possibly DDP/DeepSpeed wrapped) module so gradient sync hooks run."""

    @property
    @abstractmethod
    def num_depths(self) -> int:
        """K: how many depths `forward` reports accuracies for."""

    @abstractmethod
    def anchor_logits(self, input_ids: Tensor, feats: TargetFeatures) -> list[Tensor]:
        """Teacher-forced drafts: element d-1 holds the logits [B, T, V] of the depth-d draft made from
        each anchor position (what `forward` scores, and what the inference hooks must reproduce)."""

    @abstractmethod
    def draft_state(self, batch_size: int, max_len: int) -> Any:
        """Fresh per-generation state (e.g. the head's own KV cache for the committed context)."""

    @abstractmethod
    def draft_begin(self, state, tokens: Tensor, feats: TargetFeatures, positions: Tensor,
                    num_valid: Tensor) -> tuple[Tensor, Tensor]:
        """Consume newly committed context -> (logits [B, V] for x_{m+1}, hidden [B, h] to expand from).

        feats [B, n] are the target's features at positions s..m-1 (positions [B, n]) and tokens [B, n]
        are x_{s+1}..x_m (each token is the one *after* its feature's position); rows are left-aligned,
        num_valid[b] entries valid (>= 1)."""

    @abstractmethod
    def draft_expand(self, state, depth: int, tokens: Tensor, parent_hidden: Tensor, parents: Tensor,
                     positions: Tensor) -> tuple[Tensor, Tensor]:
        """One tree level -> (logits [B, n, V] of the token after each node, hidden [B, n, h]).

        tokens [B, n] are candidate draft tokens at `depth` (1 = x_{m+1}); parents [B, n] index the node
        each one hangs from in the order nodes were passed to earlier calls of this round (-1 = the root
        returned by draft_begin). Nodes attend to the committed context and their own ancestors only."""

    @abstractmethod
    def draft_end(self, state) -> None:
        """Forget this round's tree (the committed context stays)."""

    # ---------------------------------------------------------------- building and attaching
    @classmethod
    def build(cls, target: Target, **options) -> "DraftHead":
        head = cls(target.config, **options)
        head.attach(target)
        head.init_from_target()
        return head

    def attach(self, target: Target) -> None:
        """Borrow the frozen target pieces this head reuses (embedding, norm, LM head, rotary)."""
        self.target_spec = target.spec
        self.frozen.clear()
        self.frozen.update(target_parts(target.model))
        self._rows.clear()  # rows copied from another target's matrices (keyed by their addresses)

    def init_from_target(self) -> None:
        """Copy target weights into the head's own parameters where the design says so (e.g. Medusa's
        LM heads start as the target's); called once at build, never on load."""

    def init_from_data(self, token_counts: Tensor) -> None:
        """See the training data before training: `token_counts` [V] is the frequency of each target token
        among loss-masked tokens. Heads with a `train_vocab` option train their read-out over that many
        most frequent tokens (EAGLE-3 overrides this to pick its draft vocabulary)."""
        size = self.options.get("train_vocab")
        V = self.target_config.vocab_size
        self._train_ids = None if size is None or size >= V else most_frequent(token_counts, size)

    def carry_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A saved state of this kind, fitted to this head where its data-chosen sizes differ (`init_from`
        with another draft vocabulary: EAGLE-3 overrides this). The base heads have none: as saved."""
        return state

    def feature_layers(self) -> list[int]:
        """The hidden_states indices the head reads (the final-normed last one is always given)."""
        return [self.target_config.num_hidden_layers]

    @property
    def max_draft_depth(self) -> int | None:
        """The deepest draft this head can make (None: unbounded, e.g. EAGLE's feature autoregression)."""
        return self.num_depths

    # helpers every head uses
    def embed(self, tokens: Tensor) -> Tensor:  # [B, T] -> [B, T, h]
        return self.frozen["embed_tokens"](tokens)

    def target_logits(self, hidden: Tensor) -> Tensor:  # [..., h] -> [..., V]
        return self.frozen["lm_head"](hidden)

    # ------------------------------------------------------------------- draft vocabulary (inference)
    own_draft_vocab = False  # True: the head's own read-out scores only a vocabulary its training chose (EAGLE-3)

    def set_draft_vocab(self, size: int | None) -> None:
        """Draft among the `size` most frequent training tokens (ties, and heads saved without counts:
        lower ids first, i.e. BPE merge order, which tracks frequency); None or >= V: the whole vocabulary."""
        V = self.target_config.vocab_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise HeadError(f"draft_vocab must be >= 1 (an integer), null (the whole vocabulary) or auto, got {size!r}")
        self._rows.clear()
        if size is None or size >= V:
            self.draft_vocab = None
            return
        counts = self.token_counts if self.token_counts is not None else torch.zeros(V, dtype=torch.long)
        self.draft_vocab = most_frequent(counts, size)

    def draftable(self) -> Tensor:
        """[V] bool: the target tokens a draft can propose (the draft vocabulary; all without one)."""
        mask = torch.zeros(self.target_config.vocab_size, dtype=torch.bool)
        mask[slice(None) if self.draft_vocab is None else self.draft_vocab.cpu()] = True
        return mask

    def readout_rows(self, num_rows: int, row_ids: Tensor | None = None) -> int:
        """How many rows of a read-out matrix (num_rows rows scoring `row_ids`) a draft step reads."""
        if self.draft_vocab is None:
            return num_rows
        ids = torch.arange(num_rows) if row_ids is None else row_ids.cpu()
        return int(torch.isin(ids, self.draft_vocab).sum())

    def draft_level_params(self) -> int:
        """Weights one draft level reads (one tree depth; a memory-bound decode step reads each weight
        once): by default every weight of the head plus the target's LM head rows it reads. Heads with one
        module per depth, or their own read-out, count just what one depth uses."""
        h = self.target_config.hidden_size
        return sum(p.numel() for p in self.parameters()) + self.readout_rows(self.target_config.vocab_size) * h

    def readout(self, hidden: Tensor, linear: nn.Linear, row_ids: Tensor | None = None) -> Tensor:
        """Draft logits [..., V] = linear(hidden [..., h]), a bias-free read-out whose R rows score target
        ids `row_ids` [R] (None: row r is token r). Under a draft vocabulary only its rows are read."""
        V = self.target_config.vocab_size
        if self.draft_vocab is None or self.training:  # the module call keeps ZeRO-3 gathering its weight
            logits = linear(hidden)
            return logits if row_ids is None else _scatter_vocab(logits, row_ids, V)
        weight = linear.weight
        # a weight layout may run a subset of the layer's rows through its own kernel (heads.kernels.blocks: the
        # target's read-out from its GGUF codes); then the kept rows are read from there, else as fp32 copies
        restrict = getattr(vars(linear).get("forward"), "restricted", None)
        key = (weight.data_ptr(), tuple(weight.shape), restrict is not None)
        if key not in self._rows:  # once per matrix: the kept rows, contiguous, and the ids they score
            ids = torch.arange(weight.shape[0]) if row_ids is None else row_ids.cpu()
            keep = torch.isin(ids, self.draft_vocab).nonzero()[:, 0]
            rows = restrict(keep) if restrict is not None else weight[keep.to(weight.device)].contiguous()
            self._rows[key] = (rows, ids[keep].to(weight.device))
        rows, ids = self._rows[key]
        logits = rows(hidden) if callable(rows) else hidden @ rows.T  # [..., R]
        return _scatter_vocab(logits, ids, V)

    # ---------------------------------------------------------------------- training vocabulary
    # A draft can only be accepted if the drafter proposes the target's token, and at inference drafts
    # read out over the most frequent tokens only (the draft vocabulary). Training over the same kind of
    # subset costs Vt/V of the [V, h] read-out (most of a step for a small head on a large vocabulary):
    # logits, the target's distribution and labels all live on the Vt training ids; the target's
    # probability mass outside them is dropped by renormalising there, and a position whose label lies
    # outside can never be drafted, so it counts as a miss in the depth accuracies.
    @property
    def train_ids(self) -> Tensor | None:
        """[Vt] ascending target ids the training read-out scores (None: the whole vocabulary)."""
        return self._train_ids

    def _ids_on(self, device) -> Tensor | None:
        ids = self.train_ids
        return None if ids is None else ids.to(device)

    def train_readout(self, hidden: Tensor, linear: nn.Linear) -> Tensor:
        """Training logits [..., Vt] = linear(hidden [..., h]) on the training ids only (a bias-free
        read-out whose row r scores token r; gradients reach only the rows that are read)."""
        ids = self._ids_on(hidden.device)
        if ids is None or linear.weight.numel() == 0:  # whole vocabulary, or a ZeRO-3 shard: the module call
            logits = linear(hidden)
            return logits if ids is None else logits[..., ids]
        if linear.weight.requires_grad:  # a trained read-out: gather its rows in the graph
            return hidden @ linear.weight[ids].T
        return hidden @ self._frozen_train_rows(linear.weight, ids)

    def _frozen_train_rows(self, weight: Tensor, ids: Tensor) -> Tensor:
        """[h, Vt] the training rows of a frozen read-out, transposed, contiguous and in the dtype autocast
        multiplies in: gathered once, not in every step (gathering 4,096 of SmolLM2's 49,152 rows and casting
        them to bf16 cost ~7 ms per read-out on a 2-core CPU, and the transposed copy multiplied slower)."""
        dtype = weight.dtype
        if torch.is_autocast_enabled(weight.device.type):
            dtype = torch.get_autocast_dtype(weight.device.type)
        matrix = (weight.data_ptr(), weight._version, dtype)  # attach() clears the cache when the target changes
        cached = self._rows.get("train")  # one entry: (matrix, ids, rows)
        if cached is None or cached[0] != matrix or not torch.equal(cached[1], ids):  # ids by value, not address
            cached = self._rows["train"] = (matrix, ids.clone(), weight.detach()[ids].T.to(dtype).contiguous())
        return cached[2]

    @torch.no_grad()
    def target_train_logits(self, feats: TargetFeatures, where: Tensor | None = None) -> Tensor:
        """The target's logits on the training ids, [B, T, Vt], or [n, Vt] at the positions `where` [B, T]
        selects (read from the cache, or computed through only those rows of its frozen LM head), in the dtype
        they come in: the losses raise them to fp32 block by block (TargetDistribution)."""
        ids = self._ids_on(feats.last_hidden.device)
        if feats.logits is not None:
            logits = feats.logits if where is None else feats.logits[where]
            return logits if ids is None else logits[..., ids]
        hidden = feats.last_hidden if where is None else feats.last_hidden[where]
        return self.train_readout(hidden, self.frozen["lm_head"])

    def train_token_ids(self, compact: Tensor) -> Tensor:
        """Training-vocabulary indices -> target token ids (e.g. of an argmax)."""
        ids = self._ids_on(compact.device)
        return compact if ids is None else ids[compact]

    def train_labels(self, labels: Tensor, ignore_index: int = -100) -> Tensor:
        """Target token ids -> training-vocabulary indices (`ignore_index` for tokens outside it)."""
        ids = self._ids_on(labels.device)
        if ids is None:
            return labels
        slot = torch.searchsorted(ids, labels).clamp(max=ids.numel() - 1)
        return torch.where(ids[slot] == labels, slot, torch.full_like(labels, ignore_index))

    # ---------------------------------------------------------------------------- saving and loading
    def head_config(self) -> dict[str, Any]:
        cfg = self.target_config
        return {
            "headway_format": FORMAT_VERSION,
            "head_kind": self.kind,
            "options": self.options,
            "target": self.target_spec.to_dict() if self.target_spec else None,
            "target_shape": {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                             "num_hidden_layers": cfg.num_hidden_layers, "model_type": cfg.model_type},
        }


def most_frequent(token_counts: Tensor, k: int) -> Tensor:
    """The k most frequent token ids [k], ascending (ties: lower id first, i.e. BPE merge order, which
    tracks frequency)."""
    ranking = torch.sort(token_counts.long().cpu(), descending=True, stable=True).indices
    return ranking[:k].sort().values


def _scatter_vocab(logits: Tensor, ids: Tensor, vocab_size: int) -> Tensor:  # [..., R] -> [..., V]
    full = logits.new_full(logits.shape[:-1] + (vocab_size,), float("-inf"))
    return full.index_copy(-1, ids, logits)


def build_head(kind: str, target: Target, **options) -> DraftHead:
    if kind not in HEAD_REGISTRY:
        _import_builtin_heads()
    if kind not in HEAD_REGISTRY:
        raise HeadError(f"unknown head {kind!r}: choose one of {sorted(HEAD_REGISTRY)}")
    return HEAD_REGISTRY[kind].build(target, **options)


def _import_builtin_heads() -> None:
    import importlib
    import pkgutil

    from headway import heads

    for mod in pkgutil.iter_modules(heads.__path__):
        if mod.name not in {"base", "target"}:
            importlib.import_module(f"headway.heads.{mod.name}")


def save_head(head: DraftHead, directory: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (+ token counts) as one folder, atomically."""
    from safetensors.torch import save_file

    head = unwrap(head)
    with atomic_path(directory, directory=True) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "head_kind": head.kind})
        if head.token_counts is not None:
            save_file({"token_counts": head.token_counts.long().cpu().contiguous()}, str(tmp / COUNTS_NAME))
        config = dict(head.head_config(), **(extra or {}))
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, default=str) + "\n")
    return Path(directory)


def read_head_config(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise HeadError(f"{directory} is not a head folder: it needs {CONFIG_NAME} and {WEIGHTS_NAME} "
                        f"(pass a run's final/ or checkpoints/best/)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise HeadError(f"{path} is not valid JSON ({exc.msg}): re-export or re-train the head") from exc
    if "head_kind" not in config:
        raise HeadError(f"{path} has no head_kind: it was not written by headway")
    return config


def load_head(directory: str | os.PathLike, target: Target | None = None, device="cpu",
              trust_remote_code: bool = False) -> DraftHead:
    """Rebuild a head from its folder. Without `target`, the target recorded in the folder is loaded, with
    `trust_remote_code` as the caller says (never as the folder says: see heads.target.recorded_spec)."""
    from headway.heads.target import load_target, recorded_spec

    config = read_head_config(directory)
    if target is None:
        if not config.get("target"):
            raise HeadError(f"{directory} records no target: pass one explicitly")
        target = load_target(recorded_spec(config["target"], trust_remote_code), device=device)
    check_fits_target(config, target, directory)
    kind = config["head_kind"]
    if kind not in HEAD_REGISTRY:
        _import_builtin_heads()
    if kind not in HEAD_REGISTRY:
        raise HeadError(f"{directory} holds an unknown head kind {kind!r}")
    head = HEAD_REGISTRY[kind](target.config, **config["options"])
    head.attach(target)
    load_weights(head, directory)
    head.token_counts = load_counts(directory, target.config.vocab_size)
    head.acceptance = recorded_acceptance(config)
    dtype = next(target.model.parameters()).dtype
    return head.to(device=device, dtype=dtype).eval()


def load_weights(head: DraftHead, directory: str | os.PathLike, carry: bool = False) -> None:
    """Fill `head` (built, attached) with the weights of the head folder `directory`; `carry`: fitted by
    `head.carry_state` first (a run started from a head with another draft vocabulary)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(Path(directory) / WEIGHTS_NAME))
    except (SafetensorError, OSError) as exc:
        raise HeadError(f"{Path(directory) / WEIGHTS_NAME} is corrupted or unreadable ({exc}): "
                        f"re-export or re-train the head") from exc
    if carry:
        state = head.carry_state(state)
    check_shapes(state, head.state_dict(), directory, head.kind)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise HeadError(f"{directory} does not match a {head.kind} head with these options: "
                        f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")


def recorded_acceptance(config: dict) -> list[float]:
    """Per-depth chain acceptance from the head's last validation (config.json training.validation
    acc_depth_1, acc_depth_2, ...), up to the first depth that was not measured (missing or 0)."""
    validation = (config.get("training") or {}).get("validation") or {}
    rates = []
    while validation.get(f"acc_depth_{len(rates) + 1}"):
        rates.append(float(validation[f"acc_depth_{len(rates) + 1}"]))
    return rates


def load_counts(directory: str | os.PathLike, vocab_size: int) -> Tensor | None:
    """The training token counts saved with a head folder (heads saved before they were kept have none)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / COUNTS_NAME
    if not path.is_file():
        return None
    try:
        counts = load_file(str(path))["token_counts"]
    except (SafetensorError, OSError, KeyError) as exc:
        raise HeadError(f"{path} is corrupted or unreadable ({exc}): delete it to draft over the whole "
                        f"vocabulary, or re-train the head") from exc
    if counts.shape != (vocab_size,):
        raise HeadError(f"{path} holds counts for {counts.shape[0]} tokens, the target has {vocab_size}")
    return counts


def check_shapes(found: dict[str, Tensor], expected: dict[str, Tensor], where, kind: str) -> None:
    """Every saved tensor the head has must have the head's shape on this target (a target with other layer
    sizes, e.g. another intermediate_size, builds a head with other shapes)."""
    for name, tensor in found.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise TargetError(f"{where}: tensor {name} is {list(tensor.shape)}, but a {kind} head on this target "
                              f"needs {list(expected[name].shape)}: the head was trained for a target of other "
                              f"shapes; use the target its config.json records")


def check_fits_target(config: dict, target: Target, where) -> None:
    shape = config.get("target_shape", {})
    cfg = target.config
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if key in shape and shape[key] != getattr(cfg, key):
            raise TargetError(f"head in {where} was trained for a target with {key}={shape[key]}, "
                              f"but this target has {key}={getattr(cfg, key)}: use the matching target")


def unwrap(module: nn.Module) -> nn.Module:
    """The head inside a DDP/DeepSpeed wrapper."""
    while hasattr(module, "module") and isinstance(module.module, nn.Module):
        module = module.module
    return module
