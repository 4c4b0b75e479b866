"""RolloutTrainer: what TRL's on-policy trainers (GRPO, RLOO, Distillation) share, on the shared engine: the prompt
rows, the generation rounds, the micro-batches they are cut into and the training forward over them.

A round (TRL's `_generate_and_score_completions`), on the MAIN thread with the current weights: this rank's share
of `generation_batch_size / num_generations` prompts is sampled (each epoch a new shuffle, incomplete rounds
dropped, as TRL's RepeatSampler), rendered (plain string as is; conversations with the chat template; an `images`
column filled into the first user message), left-padded, and `mlxrl.generation.engine.generate` draws G
completions per prompt with the prompt prefilled ONCE and its KV cache shared (G = 1: one per prompt). The round
is cut into `steps_per_generation` micro-batches of `per_device_train_batch_size` completions that keep whole
groups together, so the training forward can share each prompt: `shared_prompt_hidden`, each prompt (and its
images) once per group, the completions attending to its keys / values with the gradient flowing through them.

A subclass says what a round is trained on (`generate_round`: GRPO's rewards and advantages, Distillation's
nothing more) and its loss; `token_sum_loss` says how each micro-batch's share of the normaliser is counted.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ...data.files import naming_rows, origins_of, rows_fingerprint
from ...data.formats import DataError, chatml, check_prompt_rows, template_kwargs
from ...data.images import fill_images, row_images
from ...errors import MlxrlError, first_line
from ...models.dropout import eval_mode
from ...processing.tokens import QWEN_STOP_TOKEN_IDS
from ..engine import Trainer, step_seed
from .environments import Environments
from .rounds import GenerationRounds
from .tools import RoundProblems, ToolBox, ToolRollout, tool_schema

PROMPT_MULTIPLE = 32  # prompts are left-padded to a multiple of this

__all__ = ["RolloutTrainer", "PROMPT_MULTIPLE"]


def _bucket(n: int, limit: int) -> int:
    """Next power of two >= n (at least 8), capped at limit: completion widths the compiled step sees."""
    return min(max(8, 1 << max(0, math.ceil(math.log2(max(n, 1))))), max(limit, n))


class RolloutTrainer(Trainer):
    """The rollout machinery; subclasses set `config_class`, `check_args`, `G` (completions per prompt) and
    `batching()`, and implement `generate_round` and `loss`."""

    G = 1

    def _init_rollout(self, name: str, model, processor, args, train_dataset, eval_dataset, tools=None,
                      environment_factory=None) -> None:
        """The shared part of a rollout trainer's constructor, after its own argument checks. tools: Python
        functions the model may call while it generates (`tools.ToolBox`); environment_factory: TRL's
        per-rollout environments whose methods are tools too (`environments.Environments`)."""
        if train_dataset is None or len(train_dataset) == 0:
            raise ValueError(f"{name} needs a train_dataset of rows with a 'prompt' column")
        if eval_dataset is not None:
            raise ValueError(f"eval_dataset is not supported by mlxrl's {name} yet")
        with naming_rows(origins_of(train_dataset)):
            check_prompt_rows(train_dataset)
        self.environments = None
        if environment_factory is not None:
            self.environments = Environments(environment_factory, tools or [])
            tools = self.environments.all_tools()
        if not tools and args.max_tool_calling_iterations is not None:
            raise ValueError("max_tool_calling_iterations is set but no tools= were given to the trainer")
        if tools and any(isinstance(train_dataset[i]["prompt"], str) for i in range(min(64, len(train_dataset)))):
            raise ValueError("tools= needs conversational prompts (lists of messages): a plain-text prompt has no "
                             "chat template to describe the tools in")
        self.toolbox = ToolBox(tools, processor, args.tool_call_timeout) if tools else None
        if self.environments is not None and self.toolbox is not None:
            self._env_schemas = {k: [tool_schema(t) for t in v] for k, v in self.environments.tools.items()}
        self._completion_prompts = self._round_environments = None  # a round's, with environments
        self.problems = RoundProblems()  # what failed in a round's tools and environments: logged once per kind
        Trainer.__init__(self, model, processor, args)
        self.rows = list(train_dataset)
        self.rows_fingerprint = rows_fingerprint(train_dataset)  # what a checkpoint's data position refers to
        self.row_origins = origins_of(train_dataset)
        # generation_batch_size counts every process's completions (TRL's); prompts_per_round is this rank's
        self.steps_per_generation, self.generation_batch_size = self.batching()
        self.prompts_per_round = self.generation_batch_size // self.world_size // self.G
        if self.prompts_per_round * self.world_size > len(self.rows):
            raise ValueError(f"a generation round needs {self.prompts_per_round * self.world_size} prompts "
                             f"(generation_batch_size / num_generations) but the dataset has {len(self.rows)}")
        self.stop_token_ids = sorted({*QWEN_STOP_TOKEN_IDS, int(processor.eos_token_id)})
        self._round_epoch = 0  # the epoch of the round being generated (reward functions see it)
        self.generation_time = 0.0
        self._head_trainable = self.head_trainable

    def batching(self) -> tuple[int, int]:
        """(steps_per_generation, generation_batch_size: completions a round over every rank)."""
        a = self.args
        spg = a.gradient_accumulation_steps
        return spg, a.per_device_train_batch_size * self.world_size * spg

    def plan_shape(self) -> tuple[dict, str]:
        """The planner's prompt length: the longest of the first 64 prompts, rendered and tokenised
        (an image counts as its one placeholder token: image tokens are not counted)."""
        n = 0
        for i, row in enumerate(self.rows[:64]):
            text = self._render(row, i)[0]
            n = max(n, len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]))
        return {"prompt_length": n}, f"prompts of {n} tokens and every completion at max_completion_length"

    # ------------------------------------------------------------------ prompts
    def _render(self, row: dict, index: int, prompt=None) -> tuple[str, list, object]:
        """(prompt text, images, the prompt as reward functions see it); the row was checked by
        `check_prompt_rows`, and what the chat template still cannot render is one line naming it. prompt:
        the row's prompt with its environment's observation (`environments`)."""
        check_prompt_rows([row], first_index=index)
        prompt = row["prompt"] if prompt is None else prompt
        images = row_images(row)
        if isinstance(prompt, str):
            return prompt, [], prompt
        messages, ordered = fill_images(chatml(prompt), images, index)
        kw = dict(template_kwargs(row, index))
        if self.environments is not None and self.toolbox is not None:
            kw["tools"] = self._env_schemas[self.environments.name_of(row, index)] or None
        elif self.toolbox is not None:
            kw["tools"] = self.toolbox.schemas
        kw["continue_final_message" if messages[-1].get("role") == "assistant" else "add_generation_prompt"] = True
        try:
            text = self.processor.apply_chat_template(messages, **kw)
        except Exception as e:  # jinja's errors for what the template cannot render
            raise DataError(f"row {index}: the chat template cannot render its prompt ({type(e).__name__}: "
                            f"{first_line(e)})") from None
        return text, ordered, messages

    def _round_indices(self, round_index: int) -> tuple[list[int], int, int]:
        """(this rank's prompts of the round, epoch, global position of its first prompt). A round
        holds prompts_per_round prompts per rank; rank r takes the r-th slice of the global round."""
        n, k = len(self.rows), self.prompts_per_round
        per_epoch = n // (k * self.world_size)
        epoch, pos = divmod(round_index, per_epoch)
        order = (np.random.default_rng((self.data_seed, epoch)).permutation(n) if self.args.shuffle_dataset
                 else np.arange(n))
        first = (pos * self.world_size + self.rank) * k
        return order[first:first + k].tolist(), epoch, self.rank * k

    def _gather(self, x: np.ndarray) -> np.ndarray:
        """Concatenate an [N, ...] float array over the ranks in rank order (identity with one)."""
        if self.world_size == 1:
            return x
        return self.parallel.all_gather(x)

    # ------------------------------------------------------------------ generation round
    def _model_kwargs(self, batch):
        if "pixel_values" not in batch:
            return {}
        return {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"],
                "vision_meta": batch.get("vision_meta")}

    def generate_round(self, round_index: int) -> tuple[list[dict], dict]:
        raise NotImplementedError

    @property
    def _prompts_per_micro_batch(self) -> int:
        return max(1, self.args.per_device_train_batch_size // self.G)

    def _generate(self, round_index: int) -> tuple[list[dict], list, list]:
        """The round's prompts (this rank's share), rendered, and their completions: (rows, rendered,
        [(the encoded prompts, the generation)] per micro-batch of prompts)."""
        from ...generation.engine import generate

        a, G = self.args, self.G
        indices, self._round_epoch, offset = self._round_indices(round_index)
        rows = [self.rows[i] for i in indices]
        if getattr(self, "rollout_func", None) is not None:
            return self._rollout_func_round(rows, indices)
        per_completion = bound = None
        if self.environments is not None:
            rendered, per_completion, bound = self._environment_prompts(rows, indices)
        else:
            rendered = [self._render(r, i) for r, i in zip(rows, indices, strict=True)]
        prompts_per_mb = self._prompts_per_micro_batch
        chunks = []
        with eval_mode(self.model):
            for start in range(0, len(rows), prompts_per_mb):
                part, samples = rendered[start:start + prompts_per_mb], G
                if per_completion is not None:  # observations differ within a group: a prompt per completion
                    part, samples = per_completion[start * G:(start + prompts_per_mb) * G], 1
                images = [im for _, im, _ in part]
                enc = self.processor(text=[t for t, _, _ in part], images=images if any(images) else None,
                                     padding_side="left", return_tensors="np")
                gen = generate(self.model, mx.array(enc["input_ids"].astype(np.int32)),
                               mx.array(enc["attention_mask"].astype(np.int32)),
                               pixel_values=mx.array(enc["pixel_values"]) if "pixel_values" in enc else None,
                               image_grid_thw=mx.array(enc["image_grid_thw"].astype(np.int32))
                               if "image_grid_thw" in enc else None,
                               num_generations=samples, max_tokens=a.max_completion_length,
                               temperature=a.temperature,
                               top_p=a.top_p, top_k=a.top_k, min_p=a.min_p or 0.0,
                               stop_token_ids=self.stop_token_ids, pad_token_id=self.processor.pad_token_id,
                               seed=step_seed(a.seed, offset + start, round_index),
                               shared_prefill=a.shared_prefill, keep_state=self.toolbox is not None)
                if self.toolbox is not None:
                    kws = [template_kwargs(r, i) for r, i in zip(rows[start:start + prompts_per_mb],
                                                                   indices[start:start + prompts_per_mb], strict=True)
                           for _ in range(G)]
                    thinking = [self.toolbox.opens_thinking(t) for t, _, _ in part for _ in range(samples)]
                    gen = self._tool_turns(enc, gen, step_seed(a.seed, offset + start, round_index), thinking, kws,
                                           None if bound is None else bound[start * G:(start + prompts_per_mb) * G])
                chunks.append((enc, gen))
        self.problems.report()
        return rows, rendered, chunks

    def _rollout_func_round(self, rows: list[dict], indices: list[int]):
        """TRL's rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", optional "env_mask"
        (0 on tokens the model did not write: context, not trained) and more fields (passed to the reward
        functions)}: the round's episodes made by the user's function instead of the engine; one prompt per
        completion in the round's order (each row's prompt G times)."""
        G, pad = self.G, self.processor.pad_token_id
        rendered = [self._render(r, i) for r, i in zip(rows, indices, strict=True)]
        prompts = [r["prompt"] for r in rows for _ in range(G)]
        try:
            out = self.rollout_func(prompts, self)
        except Exception as e:
            raise MlxrlError(f"rollout_func raised {type(e).__name__}: {first_line(e)} (step "
                             f"{self.global_step + 1}; MLXRL_DEBUG=1 shows the traceback)") from e
        missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - set(out or {}))
        if missing:
            raise MlxrlError(f"rollout_func must return keys {missing} in its output dict.")
        n = len(prompts)
        for k, v in out.items():
            if len(v) != n:
                raise MlxrlError(f"rollout_func returned {len(v)} {k!r} for {n} prompts (each row's prompt "
                                 f"num_generations times): one per completion")
        env_mask = out.get("env_mask")
        self._round_extra = {k: list(v) for k, v in out.items()
                             if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        stops = set(self.stop_token_ids) | {pad}
        chunks, per_mb = [], self._prompts_per_micro_batch * G
        for start in range(0, n, per_mb):
            p_list = [list(map(int, p)) for p in out["prompt_ids"][start:start + per_mb]]
            c_list = [list(map(int, c))[:self.args.max_completion_length]
                      for c in out["completion_ids"][start:start + per_mb]]
            shared = all(p_list[i] == p_list[i - i % G] for i in range(len(p_list)))
            p_rows = p_list[::G] if shared else p_list
            width = max(len(p) for p in p_rows)
            enc = {"input_ids": np.full((len(p_rows), width), pad, np.int64),
                   "attention_mask": np.zeros((len(p_rows), width), np.int64)}
            for i, p in enumerate(p_rows):
                enc["input_ids"][i, width - len(p):], enc["attention_mask"][i, width - len(p):] = p, 1
            own = None if env_mask is None else [list(env_mask[start + i]) for i in range(len(c_list))]
            truncated = [not c or c[-1] not in stops for c in c_list]
            messages = [[{"role": "assistant", "content": self.processor.tokenizer.decode(c, skip_special_tokens=True)}]
                        if not isinstance(prompts[start + i], str) else [] for i, c in enumerate(c_list)]
            chunks.append((enc, ToolRollout.from_rows(c_list, own, truncated, pad,
                                                      messages=messages if all(messages) else [])))
        return rows, rendered, chunks

    def _environment_prompts(self, rows: list[dict], indices: list[int]):
        """With environment_factory: one environment per completion, drawn and reset with its row; (rendered
        prompts, one per row; a rendering per completion when the observations of a group differ, else None;
        each completion's tools by name). Sets the round's environments and prompts, as reward functions see
        them."""
        env, G = self.environments, self.G
        warn = self.problems.note
        names = [env.name_of(r, i) for r, i in zip(rows, indices, strict=True) for _ in range(G)]
        instances = env.draw(names)
        prompts = [env.observed(chatml(rows[k // G]["prompt"]), env.reset(inst, rows[k // G], warn))
                   for k, inst in enumerate(instances)]
        shared = all(prompts[j * G + g] == prompts[j * G] for j in range(len(rows)) for g in range(G))
        if shared:
            rendered = [self._render(r, i, prompts[j * G]) for j, (r, i) in enumerate(zip(rows, indices,
                                                                                         strict=True))]
            per_completion = None
        else:
            if any(row_images(r) for r in rows):
                raise DataError("environment observations differ between the completions of one prompt that has "
                                "images: mlxrl shares a prompt's images across its num_generations completions")
            per_completion = [self._render(rows[k // G], indices[k // G], p) for k, p in enumerate(prompts)]
            rendered = per_completion[::G]
        self._round_environments = instances
        self._completion_prompts = [r[2] for r in per_completion] if per_completion is not None else None
        return rendered, per_completion, [env.bound(inst) for inst in instances]

    def _tool_turns(self, enc, gen, seed: int, thinking: list[bool], kws: list[dict],
                    bound: list[dict] | None = None) -> ToolRollout:
        """TRL's tool loop over one micro-batch of prompts' completions: parse each row's calls, run them, append
        the tool messages' tokens and continue those rows from the engine's caches, until no row calls a tool or
        max_tool_calling_iterations turns have run (the module docstring of `tools`). bound: each completion's tools
        by name (its environment's methods)."""
        from ...generation.engine import continue_generation

        a, box, tok = self.args, self.toolbox, self.processor.tokenizer

        def parse(tokens: list, r: int) -> dict:
            message, problem = box.parse(tok.decode(tokens, skip_special_tokens=False), thinking[r])
            if problem:
                self.problems.note("a tool call that does not parse (the turn is scored as text)", problem)
            return message

        ids, mask = np.array(gen.completion_ids), np.array(gen.completion_mask)
        n = ids.shape[0]
        prompt_len = np.repeat(enc["attention_mask"].sum(1), n // enc["attention_mask"].shape[0])
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None) or 1 << 62
        seqs = [ids[r][mask[r] > 0].tolist() for r in range(n)]
        tool_mask = [[1] * len(s) for s in seqs]
        truncated = np.array(gen.truncated).copy()
        messages, active = [], []
        for r in range(n):
            message = parse(seqs[r], r)
            messages.append([message])
            if message.get("tool_calls"):
                active.append(r)
        calls = failures = 0
        turns = a.max_tool_calling_iterations if a.max_tool_calling_iterations is not None else 1 << 30
        previous, previous_rows, turn = gen, list(range(n)), 0
        while active and turn < turns:
            keep, new_tokens = [], []
            for r in active:
                results = [box.call(c, None if bound is None else bound[r])
                           for c in messages[r][-1]["tool_calls"]]
                calls += len(results)
                tool_messages = []
                for name, result, failure in results:
                    if failure:
                        failures += 1
                        self.problems.note(*failure)
                    tool_messages.append({"role": "tool", "name": name,
                                          "content": result if isinstance(result, list) else str(result)})
                suffix = box.suffix_ids(tool_messages, kws[r])
                # TRL: a tool result that would pass the completion budget (or the model's context) is rolled back
                if (len(seqs[r]) + len(suffix) > a.max_completion_length
                        or prompt_len[r] + len(seqs[r]) + len(suffix) >= limit):
                    continue
                messages[r].extend(tool_messages)
                seqs[r] += suffix
                tool_mask[r] += [0] * len(suffix)
                keep.append(r)
                new_tokens.append(suffix)
                thinking[r] = box.opens_thinking(tok.decode(suffix, skip_special_tokens=False))
            if not keep:
                break
            where = {r: i for i, r in enumerate(previous_rows)}
            budget = max(a.max_completion_length - len(seqs[r]) for r in keep)
            nxt = continue_generation(self.model, previous, [where[r] for r in keep], new_tokens, max_tokens=budget,
                                      temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p or 0.0,
                                      stop_token_ids=self.stop_token_ids, pad_token_id=self.processor.pad_token_id,
                                      seed=(seed + 7919 * (turn + 1)) % (2**31 - 1))
            out_ids, out_mask, done = (np.array(x) for x in (nxt.completion_ids, nxt.completion_mask, nxt.finished))
            active = []
            for i, r in enumerate(keep):
                drawn = out_ids[i][out_mask[i] > 0].tolist()
                room = a.max_completion_length - len(seqs[r])
                cut = len(drawn) > room
                drawn = drawn[:room]
                seqs[r] += drawn
                tool_mask[r] += [1] * len(drawn)
                truncated[r] = cut or not bool(done[i])
                if not drawn:
                    continue
                message = parse(drawn, r)
                messages[r].append(message)
                if message.get("tool_calls") and not cut:  # a cut turn's cache holds tokens past the cut
                    active.append(r)
            previous, previous_rows, turn = nxt, keep, turn + 1
        return ToolRollout.from_rows(seqs, tool_mask, truncated, self.processor.pad_token_id, messages=messages,
                                     calls=calls, failures=failures)

    def _lengths(self, chunks: list) -> tuple[list, list]:
        """(completion lengths, prompt lengths) of this rank's round, one per completion; with tools a completion's
        length counts the model's own tokens, not the tool output in it (TRL's)."""
        lengths, prompt_lens = [], []
        for enc, gen in chunks:
            own = getattr(gen, "tool_mask", None)
            lengths.extend(np.array(gen.completion_mask if own is None else own).sum(1).tolist())
            prompt_lens.extend(np.repeat(enc["attention_mask"].sum(1),
                                         len(gen.completion_ids) // len(enc["attention_mask"])).tolist())
        return lengths, prompt_lens

    def _length_metrics(self, chunks: list, lengths: list) -> dict:
        """TRL's completions/* metrics over every rank's completions of the round (`lengths`: this rank's, from
        `_lengths`)."""
        truncated = [t for _, gen in chunks for t in np.array(gen.truncated).tolist()]
        all_lengths = self._gather(np.array(lengths, dtype=np.float64)).astype(np.float64)
        all_truncated = self._gather(np.array(truncated, dtype=np.float64)) > 0.5
        term = all_lengths[~all_truncated] if (~all_truncated).any() else np.zeros(1)
        tools = {}
        if self.toolbox is not None:  # TRL's: calls per completion, failures per call, over every rank
            calls, failures = self._gather(np.array([[sum(g.calls for _, g in chunks),
                                                      sum(g.failures for _, g in chunks)]], np.float64)).sum(0)
            tools = {"tools/call_frequency": calls / len(all_lengths),
                     "tools/failure_frequency": failures / calls if calls else 0.0}
        return {**tools, "completions/mean_length": all_lengths.mean(), "completions/min_length": all_lengths.min(),
                "completions/max_length": all_lengths.max(), "completions/clipped_ratio": all_truncated.mean(),
                "completions/mean_terminated_length": term.mean(),
                "completions/min_terminated_length": term.min(),
                "completions/max_terminated_length": term.max()}

    @property
    def token_sum_loss(self) -> bool:
        """Whether the loss is a token sum over the round normalised by its completion tokens (each micro-batch's
        normaliser its share of them) rather than a mean per micro-batch (each normaliser 1)."""
        return True

    def _cut(self, chunks: list, lengths, prompt_lens: list) -> tuple[list[dict], list[slice]]:
        """The round's micro-batches: whole groups (b >= G: one chunk) or b-row slices of one prompt's group
        (b < G), completions padded to a bucket and prompts left-padded to a multiple (fewer compiled shapes),
        each with its share of the loss normaliser; and each one's rows of the round."""
        a, G, b = self.args, self.G, self.args.per_device_train_batch_size
        prompts_per_mb = self._prompts_per_micro_batch
        total_tokens, micro, slices, pad = 0, [], [], self.processor.pad_token_id
        for c, (enc, gen) in enumerate(chunks):
            ids, mask = np.array(gen.completion_ids), np.array(gen.completion_mask)
            tool_mask = getattr(gen, "tool_mask", None)  # 0 on tool output: context, never trained
            if getattr(a, "mask_truncated_completions", False):
                mask = mask * ~np.array(gen.truncated)[:, None]
            width = _bucket(ids.shape[1], a.max_completion_length)
            ids = np.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=pad)
            mask = np.pad(mask, ((0, 0), (0, width - mask.shape[1])))
            if tool_mask is not None:
                tool_mask = np.pad(tool_mask, ((0, 0), (0, width - tool_mask.shape[1])))
            total_tokens += int((mask if tool_mask is None else mask * tool_mask).sum())
            p_ids, p_mask = enc["input_ids"], enc["attention_mask"]
            extra = (-p_ids.shape[1]) % PROMPT_MULTIPLE  # left padding to a multiple: fewer compiled shapes
            p_ids = np.pad(p_ids, ((0, 0), (extra, 0)), constant_values=pad).astype(np.int32)
            p_mask = np.pad(p_mask, ((0, 0), (extra, 0))).astype(np.int32)
            base, step = c * prompts_per_mb * G, min(b, ids.shape[0])
            for s in range(0, ids.shape[0], step):
                sl = slice(base + s, base + s + step)
                own = p_ids.shape[0] == ids.shape[0] and G > 1  # a prompt per completion (environments)
                mb = {"prompt_ids": p_ids[s:s + step] if own else p_ids,
                      "prompt_mask": p_mask[s:s + step] if own else p_mask,
                      "completion_ids": ids[s:s + step].astype(np.int32),
                      "completion_mask": mask[s:s + step].astype(np.int32),
                      "num_tokens": int(sum(prompt_lens[sl]) + sum(lengths[sl]))}
                if tool_mask is not None:
                    mb["tool_mask"] = tool_mask[s:s + step].astype(np.int32)
                if "pixel_values" in enc:
                    mb["pixel_values"] = enc["pixel_values"]
                    mb["image_grid_thw"] = enc["image_grid_thw"].astype(np.int32)
                micro.append(mb)
                slices.append(sl)
        for mb in micro:  # TRL: the round's tokens x grad_accum / steps_per_generation, over one window
            mb["normalizer"] = max(total_tokens, 1) / self.steps_per_generation if self.token_sum_loss else 1.0
        return micro, slices

    # ------------------------------------------------------------------ the training forward
    @staticmethod
    def loss_mask(batch):
        """The completion tokens a loss trains on: the model's own (`completion_mask`, less the tool output in
        a tool-calling completion, `tool_mask`); `completion_mask` alone is the forward's context."""
        mask = batch["completion_mask"]
        return mask if "tool_mask" not in batch else mask * batch["tool_mask"]

    def _completion_hidden(self, model, batch, aux: list | None = None):
        """The final hidden states [n, C, D] at the completion positions (each predicting the next token). aux: a
        list receiving an MoE model's load-balancing loss over each row's prompt + completion, as TRL computes it,
        when the batch carries the engine's weight of it (`forward.with_router_aux`)."""
        from ...generation.shared_prompt import repeated_hidden, shared_prompt_hidden

        kw = self._model_kwargs(batch)
        if aux is not None and "router_aux_scale" in batch:
            kw["router_aux"] = aux
        if self.args.shared_prompt:
            if "router_aux" in kw:
                kw["completion_mask"] = batch["completion_mask"]
            return shared_prompt_hidden(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                        **kw)
        kw.pop("vision_meta", None)
        return repeated_hidden(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                               batch["completion_mask"], **kw)

    # ------------------------------------------------------------------ the batch source
    def make_source(self):
        return GenerationRounds(self)
