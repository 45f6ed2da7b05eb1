"""The inference engine: plain and speculative decoding of any HF causal LM through a paged KV cache.

API (what infer.evaluate and scripts build on)
----------------------------------------------
    from headway.heads.target import load_target, target_preset
    from headway.infer.engine import Engine, encode_prompts
    from headway.infer.drafters import build_drafter        # prompt_lookup, draft_model, or a head (+ tree policy)

    target = load_target(target_preset("smollm2-135m"))                   # conf/target/smollm2-135m.yaml
    prompts = encode_prompts(target.tokenizer, ["Write a haiku about caches."])   # chat template
    engine = Engine(target)                                               # plain decoding
    out = engine.generate(prompts, max_new_tokens=128, temperature=0.0)
    out.tokens          # list[list[int]]: new tokens per prompt (up to and including EOS)
    out.stats.tau, out.stats.acceptance_by_depth, out.stats.tokens_per_second, out.stats.to_dict()

    drafter = build_drafter("prompt_lookup", target)                      # or a head from load_head(...)
    out = Engine(target, drafter).generate(prompts, max_new_tokens=128, temperature=0.0)

`generate(prompts, max_new_tokens, temperature=0, top_k=None, top_p=None, seed=None, stop_on_eos=True)`
takes a batch of token-id lists of different lengths (rows are left-aligned with per-row lengths and
masks). Temperature 0 is greedy: the speculative output then equals plain decoding token for token.
Errors: EngineError (bad arguments, empty prompt), CacheFullError (prompt + max_new_tokens beyond the
target's max_position_embeddings, or a KV pool capped by `max_cache_tokens` running out).

Constructor: Engine(target, drafter=None, *, block_size=16, budget="auto", eos_token_id=None,
max_cache_tokens=None, weight_layout="auto", stop_unpaid_drafting="sampling"); `target` is a heads.target.Target
(or a bare HF causal LM).
Drafters keep state per generate() call, so one drafter object can serve many calls but not two engines
at once. On a CPU the engine runs the target's Linear layers in the fastest measured weight layout
(heads.kernels.weight_layout: for a GGUF target, its own block codes; same values, a faster decode step and tree).

One decoding step (gpt-fast style, everything vectorised over the batch):
    plain:        cache.prepare(1) -> target(last token) -> warp -> sample
    speculative:  drafter.propose -> tree mask/positions -> ONE target forward over the tree
                  -> warp -> verify_tree -> cache.compact(accepted path) -> drafter.commit(accepted
                  tokens + the target's hidden states at the accepted nodes)
Stats: tau = tokens emitted per target verification forward (bonus included, micro-averaged over all
row-steps), acceptance_by_depth = P(depth d accepted | depth d-1 accepted), target forwards, tokens/s,
and where the steps' time went (stats.step_ms(): a plain step; a speculative one as drafting, the tree's
forward and accepting).
The tree size comes from `drafter.plan(budget, B, target_params, greedy)`: `TreeBudget` (batch-size throttle + the
measured latency curve T(N), see infer/calibrate.py) caps it, and a head's default policy (AutoTree) picks
the tree with the most expected tokens per unit time; a plan of one node (no drafts) decodes plainly.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import Tensor

from headway.heads.base import TargetFeatures
from headway.infer.calibrate import TreeBudget, calibrate_latency  # noqa: F401  (calibrate_latency re-exported)
from headway.infer.drafters import Sampling
from headway.infer.kv_cache import CacheFullError, PagedKVCache  # noqa: F401  (CacheFullError re-exported)
from headway.heads.sampling import is_greedy, sample, warp_probs
from headway.infer.tree import ancestor_mask, attention_mask, causal_ancestors, depths
from headway.infer.verify import verify_tree
from headway.infer.payoff import DraftingGuard
from headway.heads.kernels.weight_layout import SMALL_M_KERNELS, apply_layout, candidates, current_layout

COST_WARMUP_STEPS = 4  # speculative steps of a call left out of its draft-cost measurement (one-off costs)
MIN_COST_STEPS = 8  # steps measured before a call reports what a draft level cost


class EngineError(ValueError):
    """Bad generation arguments; the message says what to do."""


@dataclass
class GenerationStats:
    target_forwards: int = 0  # verification forwards (decode steps), prefill excluded
    row_steps: int = 0  # sum over steps of rows still generating: the denominator of tau
    emitted: int = 0  # tokens emitted by those row-steps (before truncation at EOS / max_new_tokens)
    new_tokens: int = 0  # tokens returned to the caller
    accepted_at_depth: list[int] = field(default_factory=list)  # row-steps whose depth-d draft was accepted
    drafted_at_depth: list[int] = field(default_factory=list)  # row-steps that reached depth d with a draft there
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafting_stopped_at: int | None = None  # the step after which drafting stopped paying (infer.payoff)
    # where the decoding time went (seconds, summed over steps): plain steps, and speculative steps split into
    # drafting (the tree and its mask), the target's forward over the tree, and accepting (verify, cache, commit);
    # on a GPU kernels run asynchronously, so the forward's share is its launch and accepting absorbs the wait
    # (unless the drafting guard synchronises)
    plain_steps: int = 0
    plain_s: float = 0.0
    speculative_steps: int = 0
    draft_s: float = 0.0
    tree_forward_s: float = 0.0
    accept_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.emitted / max(self.row_steps, 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at_depth, self.drafted_at_depth)]

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the whole generate() wall time (prefill included)."""
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)

    def step_ms(self) -> dict:
        """Mean milliseconds per step: plain, and a speculative step by phase (None where there was none)."""
        def mean(total, n):
            return 1000 * total / n if n else None
        n = self.speculative_steps
        return {"plain": mean(self.plain_s, self.plain_steps),
                "speculative": mean(self.draft_s + self.tree_forward_s + self.accept_s, n),
                "drafting": mean(self.draft_s, n), "tree_forward": mean(self.tree_forward_s, n),
                "accepting": mean(self.accept_s, n)}

    def add(self, other: "GenerationStats") -> None:
        """Sum another call's counts and seconds into these (rates over many calls are then micro-averages);
        `drafting_stopped_at` belongs to one call and is not summed."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):  # per-depth counts: the longer list sets the depths
                mine.extend([0] * (len(theirs) - len(mine)))
                for d, n in enumerate(theirs):
                    mine[d] += n
            elif f.name != "drafting_stopped_at":
                setattr(self, f.name, mine + theirs)

    def to_dict(self) -> dict:
        return dict(asdict(self), tau=self.tau, acceptance_by_depth=self.acceptance_by_depth,
                    tokens_per_second=self.tokens_per_second)

    def record_plain(self, active: int) -> None:
        self.target_forwards += 1
        self.row_steps += active
        self.emitted += active

    def record(self, num_tokens: Tensor, tree_depth: Tensor, active: Tensor) -> None:
        """One verification step: num_tokens [B] emitted, tree_depth [B] deepest draft, active [B]."""
        num, depth = num_tokens[active], tree_depth[active]
        self.target_forwards += 1
        self.row_steps += int(active.sum())
        self.emitted += int(num.sum())
        levels = int(depth.max()) if depth.numel() else 0
        self._grow(levels)
        d = torch.arange(1, levels + 1)
        accepted = (num[:, None] - 1 >= d).sum(0)  # [D]: accepted drafts >= d
        drafted = ((num[:, None] - 1 >= d - 1) & (depth[:, None] >= d)).sum(0)
        for i in range(levels):
            self.accepted_at_depth[i] += int(accepted[i])
            self.drafted_at_depth[i] += int(drafted[i])

    def _grow(self, levels: int) -> None:
        while len(self.accepted_at_depth) < levels:
            self.accepted_at_depth.append(0)
            self.drafted_at_depth.append(0)


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per prompt
    stats: GenerationStats


def encode_prompts(tokenizer, texts: list[str], chat: bool = True) -> list[list[int]]:
    """Token ids for each prompt: a user turn through the chat template (if the tokenizer has one)."""
    out = []
    for text in texts:
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids))
    return out


class Engine:
    """Generate with a frozen target, optionally drafting with `drafter` (see infer.drafters)."""

    def __init__(self, target, drafter=None, *, block_size: int = 16, budget: TreeBudget | str = "auto",
                 eos_token_id: int | list[int] | None = None, max_cache_tokens: int | None = None,
                 weight_layout: str = "auto", stop_unpaid_drafting: str = "sampling"):
        """budget: a TreeBudget, or "auto" = this target's T(N) curve on this machine, cached on disk by
        `python -m headway.infer.calibrate` or measured (a few seconds, once) the first time a drafter runs;
        "static" = a fixed batch-size throttle only (see infer/calibrate.py).
        max_cache_tokens: cap on the KV pool (all rows together); default: room for every row's worst case.
        Past it generation stops with CacheFullError (the cache is never corrupted).
        weight_layout: how the target's Linear weights lie in memory (heads.kernels.weight_layout): "auto" = on a
        CPU the layout with the faster decode step here (measured once, cached; the gain of the wide
        weights column-major depends on the machine, see heads.kernels.weight_layout), "stock" = as loaded,
        "wide-column". Values never change; the layout is set in place on `target`.
        stop_unpaid_drafting: "sampling" (default) = when sampling (temperature > 0), decode plainly for the rest
        of a generate() call once its own speculative steps show that drafting costs more than it gains
        (infer.payoff); "always" = greedy calls too; "never". Needs the measured T(N) curve, so never with
        budget="static" (how fixed trees are measured). Unless "never", a call also tells the drafter what a
        draft level cost it (in plain steps) and which of its drafts were accepted, and an `auto` tree plans
        the next calls with that cost and that acceptance instead of the estimates from the head's weights and
        validation; "never" keeps the plan (the evaluator, which measures the head, uses it)."""
        self.model = target.model if hasattr(target, "model") else target
        self.tokenizer = getattr(target, "tokenizer", None)
        self.drafter = drafter
        self.block_size = block_size
        self.max_cache_tokens = max_cache_tokens
        if stop_unpaid_drafting not in ("sampling", "always", "never"):
            raise EngineError(f"stop_unpaid_drafting must be sampling, always or never, got {stop_unpaid_drafting!r}")
        self.stop_unpaid_drafting = stop_unpaid_drafting
        if budget not in ("auto", "static") and not isinstance(budget, TreeBudget):
            raise EngineError(f"budget must be a TreeBudget, 'auto' or 'static', got {budget!r}")
        self.target, self._budget = target, budget
        try:
            self.weight_layout = apply_layout(self.model, weight_layout, target)  # before T(N) is measured
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.num_layers = self.model.config.num_hidden_layers
        self.num_params = sum(p.numel() for p in self.model.parameters())  # what one decode step reads
        eos = eos_token_id if eos_token_id is not None else _eos_ids(self.model, self.tokenizer)
        eos = [eos] if isinstance(eos, int) else eos
        self.eos = torch.tensor(sorted(set(eos)) if eos else [-2], dtype=torch.long)

    # ------------------------------------------------------------------------------------- public
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop_on_eos: bool = True, drafter=None) -> GenerationOutput:
        drafter = drafter if drafter is not None else self.drafter
        self._check(prompts, max_new_tokens, temperature, top_k, top_p)
        if current_layout(self.model) != self.weight_layout:  # another user of the model changed it
            apply_layout(self.model, self.weight_layout)
        self._route_drafter(drafter)
        run = _Run(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos, drafter)
        return run.generate()

    def _route_drafter(self, drafter) -> None:
        """Under a CPU kernel layout, the draft head's (or draft model's) fp32 Linears run through the panel
        kernel too: a draft level multiplies 1-3 rows by a few MB of weights, where MKL's matrix-vector
        product on AMD CPUs is several times slower (docs/inference.md). Values unchanged, as for the target."""
        if drafter is None or self.weight_layout not in SMALL_M_KERNELS:
            return
        for network in drafter.networks():
            if current_layout(network) != "panel" and "panel" in candidates(network):
                apply_layout(network, "panel")

    def _check(self, prompts, max_new_tokens, temperature, top_k, top_p) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise EngineError("every prompt needs at least one token: drop empty prompts")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not math.isfinite(temperature) or temperature < 0:
            raise EngineError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise EngineError(f"top_k must be >= 1, got {top_k}")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        longest = max(len(p) for p in prompts) + max_new_tokens
        if limit and longest > limit:
            raise CacheFullError(f"prompt + max_new_tokens = {longest} tokens exceeds the target's "
                                 f"max_position_embeddings {limit}: shorten the prompt or max_new_tokens")

    @property
    def budget(self) -> TreeBudget:
        if self._budget == "auto":
            self._budget = TreeBudget.for_target(self.target, measure=hasattr(self.target, "spec"))
        elif self._budget == "static":
            self._budget = TreeBudget()
        return self._budget

    # ------------------------------------------------------------------------------ target forward
    def forward(self, cache: PagedKVCache, tokens: Tensor, num_new: Tensor, anc: Tensor, pos: Tensor,
                keep: Tensor | int, hidden: bool):
        """One target forward of tokens [B, Q] appended after each row's cached prefix.

        anc [1 or B, Q, Q] says which new tokens see which; pos [B, Q] are position ids; keep selects the
        positions whose logits are computed (int: last `keep`; [B, K] indices per row)."""
        plan = cache.prepare(num_new, tokens.shape[1])
        mask = attention_mask(plan.start, anc, plan.read_len, self.dtype,
                              None if bool((num_new == tokens.shape[1]).all()) else num_new)
        out = self.model(input_ids=tokens.to(self.device), position_ids=pos.to(self.device),
                         attention_mask=mask.to(self.device), cache=cache, use_cache=True,
                         output_hidden_states=hidden,
                         logits_to_keep=keep.to(self.device) if isinstance(keep, Tensor) else keep)
        return plan, out


class _Run:
    """The state of one generate() call."""

    def __init__(self, engine: Engine, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                 stop_on_eos, drafter):
        self.e, self.drafter = engine, drafter
        self.max_new = max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.greedy = is_greedy(temperature)  # a temperature below GREEDY_BELOW decodes greedily
        self.generator = torch.Generator(engine.device).manual_seed(seed) if seed is not None else None
        self.stop_on_eos = stop_on_eos
        self.B = len(prompts)
        self.lens = torch.tensor([len(p) for p in prompts])
        self.prompt = torch.zeros(self.B, int(self.lens.max()), dtype=torch.long)
        for b, p in enumerate(prompts):  # once per call, not in the decoding loop
            self.prompt[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        self.nodes = drafter.plan(self.e.budget, self.B, engine.num_params, self.greedy) if drafter else 1
        if self.nodes <= 1:  # drafting cannot pay here (batch throttle or cost model): decode plainly
            drafter = self.drafter = None
        # a row holds its prompt, its max_new_tokens and one tree in flight; in a speculative batch a row
        # that finished early rides along one token per step for at most max_new_tokens more steps
        ride_along = max_new_tokens if drafter and self.B > 1 else 0
        max_len = int(self.lens.max()) + max_new_tokens + ride_along + self.nodes + 1
        cap = engine.max_cache_tokens
        self.cache = PagedKVCache.for_model(engine.model.config, batch_size=self.B, max_seq_len=max_len,
                                            block_size=engine.block_size, dtype=engine.dtype,
                                            device=engine.device,
                                            num_blocks=-(-cap // engine.block_size) if cap else None)
        self.out = torch.full((self.B, max_new_tokens + self.nodes + 1), -1, dtype=torch.long)
        self.count = torch.zeros(self.B, dtype=torch.long)  # tokens emitted so far per row
        self.done = torch.zeros(self.B, dtype=torch.bool)
        self.ones, self.chain1 = torch.ones(self.B, dtype=torch.long), causal_ancestors(1)
        self.stats = GenerationStats()
        wanted = drafter.feature_layers() if drafter else []  # hidden states only for drafters that read them
        self.layers = sorted(set(wanted) | {engine.num_layers}) if wanted else []
        self.guard = self.drafting_guard()
        self.forward_s = 0.0  # the last speculative step's target forward
        self.planner = drafter  # told what its draft levels cost (even if drafting stops during the call)
        self.level_costs: list[float] = []  # per speculative step: one draft level, in plain steps

    def drafting_guard(self) -> DraftingGuard | None:
        when = self.e.stop_unpaid_drafting
        if not self.drafter or when == "never" or (when == "sampling" and self.greedy):
            return None
        budget = self.e.budget
        if not budget.curve:
            return None
        return DraftingGuard(budget.latency(self.B * self.nodes) / budget.latency(self.B))

    def generate(self) -> GenerationOutput:
        t0 = time.perf_counter()
        root = self.prefill()
        t1 = time.perf_counter()
        while not bool(self.done.all()):
            if self.drafter is None:
                start = time.perf_counter()
                root = self.plain_step(root)
                self.stats.plain_steps += 1
                self.stats.plain_s += time.perf_counter() - start
                continue
            start = time.perf_counter()
            root = self.speculative_step(root)
            if self.guard is not None:
                self.guard.record(time.perf_counter() - start, self.forward_s)
                if not self.guard.pays(self.stats.tau):  # the rest of this call decodes plainly
                    self.drafter = None
                    self.stats.drafting_stopped_at = self.stats.target_forwards
        t2 = time.perf_counter()
        self.report_draft_cost()
        tokens = [self.out[b, :int(self.count[b])].tolist() for b in range(self.B)]
        self.stats.new_tokens = sum(len(t) for t in tokens)
        self.stats.prefill_s, self.stats.decode_s = t1 - t0, t2 - t1
        return GenerationOutput(tokens, self.stats)

    # ---------------------------------------------------------------------------------------- steps
    def prefill(self) -> Tensor:
        """Run every prompt through the target; return the first new token [B]."""
        width = self.prompt.shape[1]
        pos = torch.arange(width).expand(self.B, width)
        keep = (self.lens - 1)[:, None]  # [B, 1] each row's last prompt position
        _, out = self.e.forward(self.cache, self.prompt, self.lens, causal_ancestors(width), pos, keep,
                                hidden=bool(self.layers))
        first = self.pick(out.logits[:, 0])  # [B]
        if self.drafter:
            self.drafter.reset(self.prompt, self.lens, self.cache.max_seq_len,
                               Sampling(self.temperature, self.top_k, self.top_p, self.generator))
            # the feature at position t predicts token t+1: tokens x_1..x_m pair with features 0..m-1
            nxt = torch.cat([self.prompt[:, 1:], self.prompt[:, :1]], 1)
            nxt.scatter_(1, keep, first[:, None])
            self.drafter.commit(nxt, self.features(out, None), pos, self.lens)
        self.emit(first[:, None], torch.ones(self.B, dtype=torch.long))
        return first

    def plain_step(self, root: Tensor) -> Tensor:
        pos = self.cache.lengths[:, None]  # [B, 1]
        _, out = self.e.forward(self.cache, root[:, None], self.ones, self.chain1, pos, 1, hidden=False)
        nxt = self.pick(out.logits[:, -1])
        self.stats.record_plain(self.B - int(self.done.sum()))
        self.emit(nxt[:, None], self.ones)
        return nxt

    def speculative_step(self, root: Tensor) -> Tensor:
        drafting = time.perf_counter()
        draft = self.drafter.propose(root, self.nodes)
        tokens, parents = draft.tokens, draft.parents
        n = tokens.shape[1]
        anc = ancestor_mask(parents)  # [B or 1, N, N]
        depth = depths(anc)
        start = self.cache.lengths
        pos = start[:, None] + depth  # [B, N]
        began = time.perf_counter()
        self.stats.draft_s += began - drafting
        plan, out = self.e.forward(self.cache, tokens.clamp(min=0), torch.full((self.B,), n), anc, pos, 0,
                                   hidden=bool(self.layers))
        if self.guard is not None and self.e.device.type == "cuda":
            torch.cuda.synchronize(self.e.device)  # the forward's time, not its launch's (the guard compares them)
        self.forward_s = time.perf_counter() - began
        self.stats.tree_forward_s += self.forward_s
        accepting = time.perf_counter()
        logits = out.logits.float()  # [B, N, V]
        dev = logits.device  # verify where the logits are; the cache's bookkeeping stays on the host
        if self.greedy:
            verified = verify_tree(tokens.to(dev), parents.to(dev), logits, greedy=True)
        else:
            probs = warp_probs(logits, self.temperature, self.top_k, self.top_p)
            q = None if draft.draft_probs is None else draft.draft_probs.to(dev)
            verified = verify_tree(tokens.to(dev), parents.to(dev), probs, q, generator=self.generator)
        new, num, path = (x.cpu() for x in verified)
        self.report_acceptance(path, num)
        # finished rows ride along (the batch keeps its shape) keeping one token per step, so their cache
        # stays within the size planned for them
        num = torch.where(self.done, 1, num)
        self.cache.compact(plan.start, path, num)
        tree_depth = (depth.expand(self.B, n) * (tokens >= 0)).amax(-1)
        self.stats.record(num, tree_depth, ~self.done)
        positions = plan.start[:, None] + torch.arange(path.shape[1])
        self.drafter.commit(new.clamp(min=0), self.features(out, path), positions, num)
        self.emit(new, num)
        done = time.perf_counter()
        self.stats.accept_s += done - accepting
        self.stats.speculative_steps += 1
        self.time_draft_level(done - drafting - self.forward_s, int(depth.max()), n)
        return new.gather(1, (num - 1)[:, None])[:, 0]

    # ------------------------------------------------------------------------------ the draft's cost
    def time_draft_level(self, draft_s: float, levels: int, nodes: int) -> None:
        """What one step spent besides its target forward (drafting, verifying, the drafter's commit), per draft
        level, in plain steps: a plain step's time is this step's own target forward scaled by the calibrated
        T(B) / T(B x nodes), so a busy machine slows both sides alike."""
        budget = self.e.budget
        if levels < 1 or not budget.curve or self.forward_s <= 0:
            return
        plain_s = self.forward_s * budget.latency(self.B) / budget.latency(self.B * nodes)
        self.level_costs.append(draft_s / levels / plain_s)

    def report_draft_cost(self) -> None:
        """Tell the drafter what a draft level cost in this call (the median step after the first few, which
        pay one-off costs), so its next plan weighs drafting by what it costs here, not by its weights."""
        costs = sorted(self.level_costs[COST_WARMUP_STEPS:])
        observe = getattr(self.planner, "observe_draft_cost", None)
        if len(costs) >= MIN_COST_STEPS and observe is not None and self.e.stop_unpaid_drafting != "never":
            observe(costs[len(costs) // 2])

    def report_acceptance(self, path: Tensor, num: Tensor) -> None:
        """Tell the drafter which of its drafts the target accepted (rows still generating), so its next plan for
        greedy calls weighs the tree by the acceptance seen here, not only by its (greedy) validation. Sampling
        calls accept less, and differently per temperature: they are not counted (the drafting guard judges them)."""
        observe = getattr(self.planner, "observe_accepted", None)
        if observe is not None and self.greedy and self.e.stop_unpaid_drafting != "never":
            active = ~self.done
            observe(path[active], num[active])

    # -------------------------------------------------------------------------------------- helpers
    def pick(self, logits: Tensor) -> Tensor:  # [B, V] -> [B]
        if self.greedy:
            return logits.argmax(-1).cpu()
        return sample(warp_probs(logits, self.temperature, self.top_k, self.top_p), self.generator).cpu()

    def features(self, out, path: Tensor | None) -> TargetFeatures | None:
        """The target hidden states the drafter asked for, at `path` [B, K] nodes (None: all positions)."""
        if not self.layers:
            return None
        hidden = {}
        for layer in self.layers:
            h = out.hidden_states[layer]  # [B, Q, h]
            if path is not None:
                h = h.gather(1, path.clamp(min=0).to(h.device)[:, :, None].expand(-1, -1, h.shape[-1]))
            hidden[layer] = h
        return TargetFeatures(hidden, self.e.num_layers)

    def emit(self, new: Tensor, num: Tensor) -> None:
        """Append new[b, :num[b]] to each active row's output; stop rows at EOS or max_new_tokens."""
        active = ~self.done
        num = torch.where(active, num, 0)
        width = new.shape[1]
        offs = torch.arange(width)
        valid = offs < num[:, None]
        if self.stop_on_eos:
            is_eos = torch.isin(new, self.e.eos) & valid
            first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, width)
            num = torch.minimum(num, first_eos)
            self.done |= is_eos.any(1) & active
            valid = offs < num[:, None]
        cols = (self.count[:, None] + offs).clamp(max=self.out.shape[1] - 1)
        self.out.scatter_(1, torch.where(valid, cols, self.out.shape[1] - 1),
                          torch.where(valid, new, self.out[:, -1:]))
        self.count = torch.minimum(self.count + num, torch.tensor(self.max_new))
        self.done |= self.count >= self.max_new


def _eos_ids(model, tokenizer) -> list[int]:
    ids = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids += list(value) if isinstance(value, (list, tuple)) else [value]
    return ids
