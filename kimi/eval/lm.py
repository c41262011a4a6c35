"""Our model as an lm-eval language model: log-likelihoods of continuations, rolling log-likelihoods of whole
texts, and greedy generation, on a KimiModel in eval mode (kimi.eval's command line, trainer.eval_tasks).

It follows lm-eval's own `hf` model wherever a choice changes a score, so that a checkpoint and its
transformers export score alike (tests/interop/test_eval.py): contexts and continuations are split as
TemplateLM splits them (context + continuation encoded whole, trailing spaces of the context moved to the
continuation), an input longer than max_length + 1 tokens loses its first tokens, an empty context and the
first window of a rolling text start from the prefix token (EOS: the token a training document follows),
and a generation's context keeps its last max_length - max_gen_toks tokens and is cut at its first stop
string. Requests are scored longest first, in batches right-padded to their longest (the model is causal,
so padding after a position changes nothing before it); generation runs one request at a time through the
decoding cache. With progress_every (python -m kimi.eval), a line on stderr at most that many seconds apart
says how far the scoring of each kind of request has come, and one line ends each kind.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch.distributed.tensor import DTensor

from kimi.model.decode import sample_next


def _whole(logits: torch.Tensor) -> torch.Tensor:
    # tensor parallelism shards logits over the vocabulary: every rank scores with all of them
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


class KimiLM(TemplateLM):
    """lm-eval's LM on `model` (a KimiModel, or the trainer's parallelised one) and its kimi Tokenizer."""

    def __init__(self, model, tokenizer, batch_size: int = 16, max_length: int = 2048, seed: int = 0,
                 progress_every: float | None = None):
        super().__init__()
        self.model, self.kimi_tokenizer = model, tokenizer
        self.batch_size, self.max_length, self.seed = batch_size, max_length, seed
        self.progress_every = progress_every  # seconds between progress lines; None: none (in training)
        self._shown = (None, 0.0, 0.0)  # (kind, its start, the last line's time)

    def _progress(self, kind: str, done: int, total: int) -> None:
        """`done` of `total` requests of `kind` scored: a line when progress_every seconds have passed since
        the last one, and when the kind is done."""
        if self.progress_every is None or total == 0:
            return
        now = time.perf_counter()
        if self._shown[0] != kind or done == 0:
            self._shown = (kind, now, now)
        _, start, last = self._shown
        if done and (done == total or now - last >= self.progress_every):
            took = now - start
            eta = f", about {took / done * (total - done):.0f} s left" if 0 < done < total else ""
            print(f"[eval] {kind}: {done}/{total} requests ({100 * done / total:.0f}%), {took:.0f} s{eta}",
                  file=sys.stderr, flush=True)
            self._shown = (kind, start, now)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.kimi_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.kimi_tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.kimi_tokenizer.encode(string)  # our tokenizers add no special tokens

    def tok_decode(self, tokens: list[int]) -> str:
        return self.kimi_tokenizer.decode(tokens)

    @torch.no_grad()
    def _score(self, inputs: list[list[int]], conts: list[list[int]],
               kind: str = "loglikelihood") -> list[tuple[float, bool]]:
        """(log p of conts[i], whether greedy decoding gives it) for each inputs[i], what the model reads:
        the context and conts[i] less its last token. Batched; log-softmax in fp32 over the scored positions
        only (a whole row of a large vocabulary's log-probabilities would not fit)."""
        out: list[tuple[float, bool]] = [(0.0, False)] * len(inputs)
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        self._progress(kind, 0, len(order))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            ids = torch.zeros(len(chunk), len(inputs[chunk[0]]), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
            logits = _whole(self.model(ids.to(self.device)))
            for row, i in enumerate(chunk):
                end, target = len(inputs[i]), torch.tensor(conts[i], device=logits.device)
                logprobs = F.log_softmax(logits[row, end - len(target):end].float(), dim=-1)
                out[i] = (float(logprobs.gather(1, target[:, None]).sum()),
                          bool((logprobs.argmax(-1) == target).all()))
            self._progress(kind, start + len(chunk), len(order))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, kind: str = "loglikelihood",
                              **kwargs) -> list[tuple[float, bool]]:
        inputs = [(context + cont)[-(self.max_length + 1):][:-1] for _, context, cont in requests]
        return self._score(inputs, [cont for _, _, cont in requests], kind)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for context, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, kind="rolling windows")):
            totals[n] += logprob
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode([self.eot_token_id])
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        out = []
        self._progress("generate_until", 0, len(requests))
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), 256)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            budget = kwargs.pop("max_gen_toks")
            temperature = kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks={budget} leaves no room for a context in max_length="
                                 f"{self.max_length}: raise max_length")
            ids = self.tok_encode(context)[-(self.max_length - budget):] or [self.prefix_token_id]
            new = self._continue(ids, budget, until, temperature, generator)
            out.append(postprocess_generated_text(self.tok_decode(new), until, None))
            self._progress("generate_until", len(out), len(requests))
        return out

    def _continue(self, ids: list[int], budget: int, until: list[str], temperature: float, generator):
        """Up to `budget` tokens after `ids`, ending early at EOS or once a stop string appears."""
        cache = self.model.new_cache()
        logits = _whole(self.model(torch.tensor([ids], device=self.device), cache=cache))
        new: list[int] = []
        while len(new) < budget:
            token = sample_next(logits[0, -1].float(), temperature, 0, generator)
            if token == self.eot_token_id:
                break
            new.append(token)
            if any(stop and stop in self.tok_decode(new) for stop in until):
                break
            logits = _whole(self.model(torch.tensor([[token]], device=self.device), cache=cache))
        return new
