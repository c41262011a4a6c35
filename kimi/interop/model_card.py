"""What makes a to-hf export publishable beside its weights: ``generation_config.json`` (what transformers'
GenerationConfig reads: the tokenizer's special ids and kimi.generate's sampling defaults) and a model card,
``README.md``: what was trained, on what data, for how long, the last losses and any eval scores the run dir
records, and how to load it. Neither is code: kimi_code.json's record (kimi.interop.trust) covers .py files
only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

GENERATION_CONFIG = "generation_config.json"
CARD = "README.md"


def generation_config(tokenizer, temperature: float, top_k: int) -> Dict[str, Any]:
    """transformers' GenerationConfig of our decoding: the sampling settings given (kimi.convert passes
    kimi.generate's defaults), its stop at EOS, and the tokenizer's ids. Rows that end early are filled with
    pad_token_id; our tokenizers have no pad piece, so that is EOS (what transformers falls back to, with a
    warning at every generate() call). No length: a max_new_tokens here would override the max_length a
    caller passes (lm-eval's HF model generated 200 tokens past its limit with one)."""
    ids = {f"{name}_token_id": i for name, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id))
           if i is not None and i >= 0}
    pad = getattr(tokenizer, "pad_id", -1)
    if pad is not None and pad >= 0:
        ids["pad_token_id"] = pad
    elif "eos_token_id" in ids:
        ids["pad_token_id"] = ids["eos_token_id"]
    return {**ids, "do_sample": temperature > 0, "temperature": temperature, "top_k": top_k}


def write_generation_config(directory: Path, *args) -> str:
    text = json.dumps(generation_config(*args), indent=2) + "\n"
    (Path(directory) / GENERATION_CONFIG).write_text(text)
    return GENERATION_CONFIG


def _last(rows: List[Dict[str, Any]], key: str, step: int) -> Optional[Dict[str, Any]]:
    """The last record at or before the exported step that has `key`."""
    return next((r for r in reversed(rows) if key in r and r.get("step", 0) <= step), None)


def eval_scores(run: Path, rows: List[Dict[str, Any]], step: int) -> List[tuple]:
    """(task, metric, score, step, where) of the scores the run dir records: trainer.eval_tasks' last
    ``eval/<task>/<metric>`` values in metrics.jsonl (its records: `rows`), and the reports
    `python -m kimi.eval output=...` wrote into the run dir (``{"step", "scores": {task: {metric:
    value}}}``)."""
    found: Dict[tuple, tuple] = {}
    for r in rows:
        if r.get("step", 0) > step:
            continue
        for key, value in r.items():
            if key.startswith("eval/") and key.count("/") >= 2 and isinstance(value, (int, float)):
                task, metric = key[len("eval/"):].split("/", 1)
                found[(task, metric)] = (value, r["step"], "metrics.jsonl")
    for path in sorted(run.glob("*.json")):
        try:
            report = json.loads(path.read_text())
            scores = report["scores"] if isinstance(report, dict) else None
            at = int(report["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(scores, dict) or at > step:
            continue
        for task, metrics in scores.items():
            for metric, value in (metrics.items() if isinstance(metrics, dict) else ()):
                if isinstance(value, (int, float)):
                    found[(task, metric)] = (value, at, path.name)
    return [(task, metric, *rest) for (task, metric), rest in sorted(found.items())]


def _data(data: Dict[str, Any]) -> str:
    """The training data in one line: the source and where it came from, or a blend's sources by weight."""
    def one(d: Dict[str, Any]) -> str:
        files = d.get("data_files") or []
        more = f" and {len(files) - 3} more files" if len(files) > 3 else ""
        where = d.get("path") or ", ".join(files[:3]) + more or d.get("name") or ""
        subset = f" ({d['config']})" if d.get("config") else ""
        return f"data.source={d.get('source')}" + (f": {where}{subset}" if where else "")

    sources = data.get("sources")
    if sources:
        return "a blend: " + "; ".join(f"{s.get('name')} (weight {s.get('weight')}, {one({**data, **s})})"
                                       for s in sources)
    return one(data)


def model_card(model, config: Dict[str, Any], step: int, run: Path, rows: List[Dict[str, Any]],
               own_code: bool, layout: str) -> str:
    """README.md of an export: `config` is the checkpoint's saved config (the whole training config, or only
    "model" for weights from-hf wrote), `run` the run dir (its eval reports) and `rows` its metrics.jsonl's
    records (kimi.run.metrics.read_metrics). It names no
    folder: the same run exported anywhere gives the same card (the loading example reads a folder or the
    Hub repo it is uploaded to)."""
    from kimi.model.config import mixer_pattern
    from kimi.model.registry import legend

    m = model.cfg
    moe = (f", {m.moe.num_experts} routed experts (top-{m.moe.top_k}) + {m.moe.shared_experts} shared from "
           f"block {m.moe.first_dense}" if m.moe.num_experts else "")
    facts = [("preset", f"model={m.name}"),
             ("architecture", f"{m.num_layers} blocks {mixer_pattern(m)} ({legend(m)}), d_model {m.d_model}, "
                              f"residual={m.residual}{moe}, vocabulary {m.vocab_size}"),
             ("parameters", f"{model.num_params():,}")]
    if "data" in config:
        facts.append(("data", _data(config["data"])))
    trainer = config.get("trainer", {})
    facts.append(("steps", f"{step:,}" + (f" of trainer.max_steps={trainer['max_steps']:,}"
                                          if "max_steps" in trainer else "")))
    tokens = _last(rows, "tokens", step)
    if tokens is not None:
        facts.append(("tokens", f"{tokens['tokens']:,} (to step {tokens['step']})"))
    for key, what in (("loss", "last training loss"), ("val_loss", "last validation loss")):
        r = _last(rows, key, step)
        if r is not None:
            facts.append((what, f"{r[key]:.4f} (step {r['step']})"))
    if not rows:
        facts.append(("losses", "none recorded (no metrics.jsonl in the run dir)"))
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- kimi", "---",
             "", f"# kimi {m.name}, step {step:,}", "",
             f"A Kimi-style language model trained with kimi, exported by `python -m kimi.convert to-hf` "
             f"({layout} layout).", "", "## Training", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value.replace('|', '/')} |" for key, value in facts]
    scores = eval_scores(run, rows, step)
    if scores:
        lines += ["", "## Evaluation", "", "| task | metric | score | step | from |", "|---|---|---|---|---|"]
        lines += [f"| {t} | {metric} | {v:.4g} | {at} | {where} |" for t, metric, v, at, where in scores]
    trust = ", trust_remote_code=True" if own_code else ""
    lines += ["", "## How to load", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'where = "path/to/this/folder"  # or the Hub repo it is uploaded to',
              f"model = AutoModelForCausalLM.from_pretrained(where{trust})",
              f"tokenizer = AutoTokenizer.from_pretrained(where{trust})",
              'ids = tokenizer("ROMEO:", return_tensors="pt").input_ids',
              "print(tokenizer.decode(model.generate(ids)[0]))  # generation_config.json: kimi.generate's "
              "sampling", "```", ""]
    if own_code:
        lines += ["The folder carries its own modeling code (the `.py` files, recorded in kimi_code.json), "
                  "which `trust_remote_code=True` runs: read it before you do.", ""]
    return "\n".join(lines)


def write_model_card(directory: Path, *args, **kwargs) -> str:
    (Path(directory) / CARD).write_text(model_card(*args, **kwargs))
    return CARD
