"""The torch trainer: one optimizer step of the policy loss over merged rows. Rows of rollouts without an
advantage (zero-variance groups) are left out; token weights are fixed for the whole step (`loss.row_weights`)
before micro-batching, so gradients accumulate to exactly one pass; logprobs are fp32, teacher-forced, at each
row's sampling temperature; under a process group each rank takes its share, weighed by the step's totals."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from lightning_dagster.engine.engine import autocast, resolve_device
from lightning_dagster.settings import trainer_threads
from lightning_dagster.training import distributed, lora
from lightning_dagster.training.advantages import Advantages
from lightning_dagster.training.loss import LossConfig, LossParts, policy_loss, row_weights
from lightning_dagster.training.transitions import Row

# --------------------------------------------------------------------------------------------- configuration


class TrainerConfigError(ValueError):
    """A trainer setting no step can run with (a NaN or negative learning rate, no epochs, ...)."""


class InvalidRows(ValueError):
    """Rows the model cannot score (`check_rows`), raised before any forward pass: nothing was changed."""


class NonFiniteUpdate(FloatingPointError):
    """A step's loss or gradient norm was NaN or infinite; the optimizer step was not taken."""


class NonFiniteWeights(FloatingPointError):
    """`save` found NaN or infinite parameters: no checkpoint was written."""


@dataclass(kw_only=True)
class TrainerConfig:
    """`lr`, `device` and `loss` are the user's (`configs.trainer_config`); `loss` None: supervised only."""

    lr: float
    device: str  # auto: CUDA when present (bf16 autocast), else CPU; or a torch device name
    loss: LossConfig | None
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0  # 0 -> plain Adam behaviour (AdamW with no decay)
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192  # padded tokens per forward pass
    epochs: int = 1  # optimizer steps over the same rows; > 1 recomputes the "old" logprobs first
    # torch threads during a step (None: `$LD_TRAINER_THREADS`, else one per core). torch has one
    # process-wide setting, and an engine in the same process sets it to 1 for sampling; a step sets its
    # own and restores it. On cores other processes keep busy, set 1: two OpenMP threads against one busy
    # core took 1.48 s an SFT step against 0.91 s for one thread (0.53 s for two on an idle machine).
    threads: int | None = None
    lora: lora.LoraSpec | None = None  # train a LoRA adapter over the frozen parent instead of every weight

    def __post_init__(self) -> None:
        def number(x: object) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

        problems = []
        if not number(self.lr) or self.lr < 0:
            problems.append(f"lr must be a finite number >= 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(number(b) and 0 <= b < 1 for b in self.betas):
            problems.append(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not number(self.weight_decay) or self.weight_decay < 0:
            problems.append(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not number(self.grad_clip) or self.grad_clip <= 0:
            problems.append(f"grad_clip must be a finite number > 0, got {self.grad_clip!r}")
        for name in ("micro_batch_tokens", "epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if problems:
            raise TrainerConfigError("; ".join(problems))


# ------------------------------------------------------------------------------------- batching and logprobs


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, R] index of the logit that predicts response token j
    targets: torch.Tensor  # [B, R] response ids
    mask: torch.Tensor  # [B, R] loss mask (0 on padding)
    behaviour: torch.Tensor  # [B, R] recorded logprobs
    temperatures: torch.Tensor  # [B] the temperature each row is scored at
    index: list[int]  # which rows of the step these are

    def to(self, device: torch.device) -> MicroBatch:
        tensors = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return MicroBatch(**tensors, index=self.index)


def micro_batches(rows: Sequence[Row], max_tokens: int) -> Iterator[MicroBatch]:
    """Rows sorted by length (less padding), packed until `max_tokens` padded tokens."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    chunk: list[int] = []
    for i in order:
        if chunk and len(rows[i]) * (len(chunk) + 1) > max_tokens:
            yield collate([rows[j] for j in chunk], chunk)
            chunk = []
        chunk.append(i)
    if chunk:
        yield collate([rows[j] for j in chunk], chunk)


def collate(rows: Sequence[Row], index: list[int]) -> MicroBatch:
    b, seq, resp = len(rows), max(len(r) for r in rows), max(len(r.response_ids) for r in rows)
    ids, attn = (torch.zeros(b, seq, dtype=torch.long) for _ in range(2))
    positions, targets = (torch.zeros(b, resp, dtype=torch.long) for _ in range(2))
    mask, behaviour = torch.zeros(b, resp), torch.zeros(b, resp)
    for i, r in enumerate(rows):
        full = r.prompt_ids + r.response_ids
        p, n = len(r.prompt_ids), len(r.response_ids)
        ids[i, : len(full)] = torch.tensor(full)
        attn[i, : len(full)] = 1
        positions[i, :n] = torch.arange(p - 1, p - 1 + n)
        targets[i, :n] = torch.tensor(r.response_ids)
        mask[i, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
        behaviour[i, :n] = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
    # each row's behaviour logprobs are under its temperature; a greedy (T=0) row's under T=1, the model's own
    temperatures = torch.tensor([float(r.temperature) if r.temperature > 0 else 1.0 for r in rows])
    return MicroBatch(ids, attn, positions, targets, mask, behaviour, temperatures, list(index))


def check_rows(rows: Sequence[Row], model: torch.nn.Module) -> None:
    """Raise `InvalidRows` for rows that would crash inside torch or write NaN weights (a transitions file,
    another model's spans: `transitions.merge_calls` checks its own)."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    positions = getattr(model.config, "max_position_embeddings", None)
    problems: list[str] = []
    for k, r in enumerate(rows):
        n = len(r.response_ids)
        why = None
        if not r.prompt_ids:
            why = "empty prompt"
        elif len(r.loss_mask) != n or len(r.behaviour_logprobs) != n:
            why = f"{n} response ids, {len(r.loss_mask)} mask values, {len(r.behaviour_logprobs)} logprobs"
        elif any(not 0 <= t < vocab for t in (*r.prompt_ids, *r.response_ids)):
            why = f"token ids outside the model's vocabulary [0, {vocab})"
        elif positions and len(r) > positions:
            why = f"{len(r)} tokens, more than the model's {positions} positions"
        elif any(m not in (0, 1) for m in r.loss_mask):
            why = "loss mask values other than 0 and 1"
        elif any(not math.isfinite(x) for x in r.behaviour_logprobs):
            why = "NaN or infinite behaviour logprobs"
        elif not 0 <= r.temperature < math.inf:
            why = f"temperature {r.temperature!r}"
        if why is not None:
            problems.append(f"row {k} (rollout {r.rollout_id}): {why}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InvalidRows(
            f"{len(problems)} of {len(rows)} rows cannot be trained: {'; '.join(problems[:3])}{more}"
        )


def response_logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """fp32 log_softmax(logits / T_row) of each response token, teacher-forced."""
    with autocast(mb.input_ids.device):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    vocab = logits.shape[-1]
    picked = logits.gather(1, mb.positions[..., None].expand(-1, -1, vocab)).float()
    logp = torch.log_softmax(picked / mb.temperatures[:, None, None], dim=-1)
    return logp.gather(-1, mb.targets[..., None]).squeeze(-1)


def load_model(model_dir: Path | str, device: torch.device | None = None) -> torch.nn.Module:
    hf_logging.disable_progress_bar()
    # dtype pinned: from_pretrained keeps a checkpoint's dtype, and the engine samples in float32: the
    # ratio to its logprobs is 1 only if the trainer scores in float32 too.
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.to(device or torch.device("cpu"))
    model.eval()  # no dropout: the ratio to the behaviour policy must be exactly 1 before the first step
    return model


# ----------------------------------------------------------------------------------------------- the trainer


@dataclass
class Prepared:
    rows: list[Row]  # the step's kept rows (every rank)
    batches: list[MicroBatch]  # this rank's share of them (all of them in one process)
    advantages: list[torch.Tensor]  # [B] per micro-batch
    weights: list[torch.Tensor]  # [B] per micro-batch
    refs: list[torch.Tensor] | None
    olds: list[torch.Tensor] | None


class Trainer:
    """One process's trainer. Under a process group every rank holds one; rank 0's `step` sends the rows to
    the others (`distributed.follow`) and each backpropagates its share through DistributedDataParallel."""

    def __init__(
        self, model_dir: Path | str, config: TrainerConfig, *, group: distributed.Group | None = None
    ):
        self.model_dir = Path(model_dir)
        self.config = config
        self.group = group
        self.device = distributed.rank_device(resolve_device(self.config.device), group)
        self.model = load_model(model_dir, self.device)
        if config.lora is not None:
            self.model = lora.wrap(self.model, config.lora)
        # the module the loss backpropagates through: DDP averages the ranks' gradients on the last backward
        self.train_model: torch.nn.Module = self.model
        if group is not None:
            cuda = [self.device] if self.device.type == "cuda" else None
            self.train_model = DistributedDataParallel(self.model, device_ids=cuda)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with LoRA: the adapter's only
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        self._ref_model: torch.nn.Module | None = None
        self.steps = 0

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen parent of the KL term, loaded at the first RL step that needs it."""
        if self.config.loss is None or not self.config.loss.kl_coef:
            return None
        if self._ref_model is None:
            self._ref_model = load_model(self.model_dir, self.device)
            self._ref_model.requires_grad_(False)
        return self._ref_model

    def _no_grad_logprobs(self, model: torch.nn.Module, batches: list[MicroBatch]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [response_logprobs(model, mb) for mb in batches]

    @property
    def loss(self) -> LossConfig:
        assert self.config.loss is not None  # `step` refuses a trainer without one
        return self.config.loss

    def prepare(self, rows: Sequence[Row], advantages: Advantages) -> Prepared | None:
        """What the step's micro-batches share; rows without an advantage are left out before weighing."""
        cfg = self.config
        kept = [r for r in rows if r.rollout_id in advantages.values and r.trained_tokens > 0]
        if not kept:
            return None
        local, totals = kept, None
        if self.group is not None:
            local = distributed.shard(kept, self.group)
            totals = distributed.step_totals(local, self.group)
        weights = row_weights(
            [r.trained_tokens for r in local], [r.rollout_id for r in local], self.loss, totals=totals
        )
        batches = [mb.to(self.device) for mb in micro_batches(local, cfg.micro_batch_tokens)] if local else []
        return Prepared(
            rows=kept,
            batches=batches,
            advantages=[
                torch.tensor([advantages.values[local[i].rollout_id] for i in mb.index], device=self.device)
                for mb in batches
            ],
            weights=[torch.tensor([weights[i] for i in mb.index], device=self.device) for mb in batches],
            refs=self._no_grad_logprobs(ref, batches) if (ref := self.ref_model) is not None else None,
            olds=self._no_grad_logprobs(self.model, batches) if cfg.epochs > 1 else None,
        )

    def backward(self, prep: Prepared) -> LossParts:
        """Zero the gradients, then accumulate the step's loss over its micro-batches (over every rank's)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.group is None:
            return self._accumulate(prep)
        if not prep.batches:  # a rank without rows still joins the gradient all_reduce, with zeros
            out = self.train_model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device))
            (out.logits.sum() * 0.0).backward()
            return distributed.reduce_parts(LossParts(loss=torch.zeros(())), self.group)
        return distributed.reduce_parts(self._accumulate(prep), self.group)

    def _accumulate(self, prep: Prepared) -> LossParts:
        total: LossParts | None = None
        # DDP averages gradients over ranks; the loss weights already divide by the whole step's totals, so
        # each rank's loss is scaled by the world size to make the average the sum (a power of two is exact)
        scale = float(self.group.world_size) if self.group is not None else 1.0
        last = len(prep.batches) - 1
        for k, mb in enumerate(prep.batches):
            # only the last backward of a step syncs gradients across ranks
            sync = contextlib.nullcontext() if k == last or self.group is None else self.train_model.no_sync()
            with sync:
                logp = response_logprobs(self.train_model, mb)
                # One update per batch: the "old" policy is the current one, so ratio == 1 with a live gradient.
                old = prep.olds[k] if prep.olds is not None else logp.detach()
                ref = prep.refs[k] if prep.refs is not None else None
                parts = policy_loss(
                    logp, old, mb.behaviour, prep.advantages[k], mb.mask, prep.weights[k], self.loss, ref
                )
                (parts.loss * scale if scale != 1.0 else parts.loss).backward()
            total = parts if total is None else total.merge(parts)
        assert total is not None
        return total

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        before = torch.get_num_threads()
        ranks = self.group.world_size if self.group is not None else 1
        torch.set_num_threads(self.config.threads or trainer_threads(ranks))
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def step(self, rows: Sequence[Row], advantages: Advantages, extra: dict | None = None) -> dict:
        """One RL update (`epochs` optimizer steps) over the rows of one batch of rollouts."""
        if self.config.loss is None:
            raise TrainerConfigError("this trainer has no loss config: it takes supervised steps only")
        check_rows(rows, self.model)  # before the other ranks are sent anything
        if self.group is not None and self.group.leader:
            distributed.broadcast((list(rows), advantages, extra), self.group)
        with self._threads():
            started = time.perf_counter()
            self.steps += 1
            metrics: dict = {"step": self.steps, "rows": len(rows), **advantages.to_dict(), **(extra or {})}
            prep = self.prepare(rows, advantages)
            if prep is None:  # every group had zero variance: nothing to learn from, no update
                return {**metrics, "trained_rows": 0, "loss": 0.0, "seconds": time.perf_counter() - started}
            for _ in range(self.config.epochs):
                parts = self.backward(prep)
                grad_norm = self._clip_and_step(parts.loss)
            seconds = time.perf_counter() - started
            tokens = sum(len(r) for r in prep.rows) * self.config.epochs
            metrics.update(parts.metrics(), trained_rows=len(prep.rows), grad_norm=grad_norm, seconds=seconds)
            return metrics | {"tokens_per_s": tokens / seconds}

    def _clip_and_step(self, loss: torch.Tensor) -> float:
        """Clip the gradients and take the optimizer step; a NaN or infinite loss or gradient is refused
        (Adam would spread it into every weight). Returns the gradient norm."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip))
        if not (math.isfinite(grad_norm) and math.isfinite(float(loss.detach()))):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdate(
                f"step {self.steps}: loss {float(loss.detach())}, gradient norm {grad_norm}; the optimizer "
                "step was not taken"
            )
        self.optimizer.step()
        return grad_norm

    def supervised_step(self, rows: Sequence[Row]) -> dict:
        """One cross-entropy step on the masked tokens (the warm start), token mean over the step."""
        if self.group is not None:
            raise distributed.DistributedError(
                "supervised_step runs in one process, not under a process group"
            )
        check_rows(rows, self.model)
        total_tokens = sum(r.trained_tokens for r in rows)
        if not total_tokens:
            raise InvalidRows(f"{len(rows)} rows with no trained token: a supervised step needs at least one")
        with self._threads():
            started = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for mb in micro_batches(rows, self.config.micro_batch_tokens):
                loss = -(response_logprobs(self.model, mb.to(self.device)) * mb.mask).sum() / total_tokens
                loss.backward()
                loss_sum += float(loss.detach())
            grad_norm = self._clip_and_step(torch.tensor(loss_sum))
            self.steps += 1
            seconds, tokens = time.perf_counter() - started, sum(len(r) for r in rows)
        return {"step": self.steps, "nll": loss_sum, "grad_norm": grad_norm, "tokens_per_s": tokens / seconds}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights (with LoRA: the adapter merged in), as an engine loads them."""
        model = lora.merged(self.model) if lora.is_wrapped(self.model) else self.model
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The trained weights (the adapter's only, with LoRA), for `restore`."""
        return lora.adapter_state(self.model) if lora.is_wrapped(self.model) else self.state_dict()

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        if lora.is_wrapped(self.model):
            lora.load_adapter_state(self.model, snapshot)
        else:
            self.model.load_state_dict(snapshot)

    def save(self, out_dir: Path | str) -> Path:
        """A Hugging Face checkpoint (the source's tokenizer, the current weights), written into a sibling
        directory first: a new `out_dir` appears whole by one rename, an existing one gets each file by an
        atomic replace, `config.json` last. Refuses (`NonFiniteWeights`) NaN or infinite parameters."""
        state = self.model.state_dict()
        bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
        if bad:
            raise NonFiniteWeights(f"{len(bad)} parameters hold NaN or infinite values (e.g. {bad[0]})")
        out = Path(out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        try:
            for f in self.model_dir.iterdir():
                if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "config.json":
                    shutil.copy2(f, tmp / f.name)
            # with LoRA: a plain checkpoint of the merged weights, the adapter alone beside it (adapter/)
            if lora.is_wrapped(self.model):
                lora.merged(self.model).save_pretrained(tmp)
                self.model.save_pretrained(str(tmp / lora.ADAPTER_DIR))
                shutil.rmtree(out / lora.ADAPTER_DIR, ignore_errors=True)
            else:
                self.model.save_pretrained(tmp)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other users
            if not out.exists():
                tmp.rename(out)
            else:
                for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
                    os.replace(f, out / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out
