"""Presets transformers' Kimi Linear cannot express (Attention Residuals, MoE variants) exported with their
own modeling code (kimi.interop.remote): AutoModelForCausalLM(trust_remote_code=True) gives our logits and
our greedy continuations through its cache, AutoTokenizer encodes like our tokenizer, and from-hf reads the
directory back bit for bit."""

import ast
import dataclasses
import functools
import json
import sys

import pytest
import torch

from helpers import MIXED_TEXT, fill_randomly, make_corpus, preset, tiny_model_cfg, write_kimi_tiktoken

pytestmark = pytest.mark.unit

TEXTS = [MIXED_TEXT, "The king loves the crown.\nA fool fears", "[EOS] </s> <s> written as text", "",
         "  leading\twhitespace \n\n trailing   "]


def make_run(directory, cfg, tokenizer):
    """A run dir holding random weights of `cfg` (every parameter and the MoE router biases drawn, so the
    gates and routing act) as its weights-only checkpoint, and `tokenizer`; returns the model."""
    from kimi import checkpoint
    from kimi.model import KimiModel

    torch.manual_seed(0)
    model = fill_randomly(KimiModel(cfg), std=0.2).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    checkpoint.save_weights(directory / "init", model.state_dict(), {"model": dataclasses.asdict(cfg)}, {})
    tokenizer.copy_to(directory / "tokenizer.model")
    return model


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A sentencepiece tokenizer as train.py trains one (384 pieces)."""
    from kimi.data.tokenizer import train_tokenizer

    corpus = make_corpus(tmp_path_factory.mktemp("corpus"), docs=4)
    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))] + [MIXED_TEXT]
    return train_tokenizer(texts, 384, tmp_path_factory.mktemp("spm") / "tokenizer.model")


@pytest.fixture(scope="module", params=["tiny", "moe_tiny"])
def exported(request, tmp_path_factory, spm):
    """(our model, the run dir, its to-hf directory, what to-hf printed) for a preset."""
    from kimi.convert import main

    root = tmp_path_factory.mktemp(request.param)
    ours = make_run(root / "run", preset(request.param, spm.vocab_size), spm)
    with pytest.MonkeyPatch.context() as mp:
        printed = []
        mp.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
        assert main(["to-hf", str(root / "run"), str(root / "hf")]) == 0
    return ours, root / "run", root / "hf", "\n".join(printed)


def load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()


@functools.lru_cache(maxsize=None)
def theirs(directory):
    """load(directory), once per directory: the tests that only run it share it."""
    return load(directory)


def test_logits_and_greedy_decoding_equal_ours(exported, spm):
    from kimi.model import lm_loss
    from kimi.model.decode import generate

    ours, _, hf_dir, printed = exported
    assert "model.residual=attnres_block" in printed and "trust_remote_code" in printed
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi.KimiForCausalLM"
    model = theirs(hf_dir)
    tokens = torch.randint(3, spm.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)
        # labels as transformers takes them: the sequence itself, shifted inside
        torch.testing.assert_close(model(tokens, labels=tokens).loss,
                                   lm_loss(ours(tokens)[:, :-1], tokens[:, 1:]))
    prompts = tokens[:, :6]
    batch = model.generate(prompts, max_new_tokens=8, do_sample=False)[:, 6:].tolist()
    for prompt, continued in zip(prompts, batch):
        mine = generate(ours, prompt, 8, temperature=0, eos_id=spm.eos_id)
        alone = model.generate(prompt[None], max_new_tokens=8, do_sample=False)[0, 6:].tolist()
        assert alone[:len(mine)] == continued[:len(mine)] == mine
        assert len(mine) == 8 or alone[len(mine)] == spm.eos_id  # ours stops before the EOS it samples
    assert model.generation_config.eos_token_id == spm.eos_id  # config.json's, the run's tokenizer's
    # a cache handed back continues where it stopped, its prompt cut by the tokens it has seen
    half = model.generate(prompts[:1], max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    more = model.generate(half.sequences, cache=half.cache, max_new_tokens=4, do_sample=False)
    assert more[0, 6:].tolist() == batch[0] == generate(ours, prompts[0], 8, temperature=0)
    # both stop at its first occurrence, theirs keeping it
    stop = generate(ours, prompts[0], 4, temperature=0)[3]
    mine = generate(ours, prompts[0], 8, temperature=0, eos_id=stop)
    assert model.generate(prompts[:1], max_new_tokens=8, do_sample=False, eos_token_id=stop)[0, 6:].tolist() \
        == mine + [stop]


def test_beam_search_through_the_cache_equals_beam_search_without_one(exported):
    """Beam search reorders our cache's rows (KimiCache.reorder_cache); without a cache every step reruns the
    whole sequence, so the two agree only if each beam's state follows it."""
    ours, _, hf_dir, _ = exported
    model = theirs(hf_dir)
    prompt = torch.randint(3, ours.cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    beams = [model.generate(prompt, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                            eos_token_id=-1, use_cache=use) for use in (True, False)]
    assert torch.equal(*beams)
    new = [tuple(b[5:].tolist()) for b in beams[0]]
    assert any(a[0] == b[0] and a != b for a in new for b in new)  # two beams of one: rows were copied


def test_buffers_and_missing_tensors_start_as_ours_would(exported, tmp_path):
    """from_pretrained fills our tensors from the file; the MoE layers' running statistics (not stored)
    start at zero, and a parameter the file lacks starts by our own init rule (a norm weight: ones)."""
    import shutil

    from safetensors.torch import load_file, save_file

    ours, _, hf_dir, _ = exported
    model = load(hf_dir)
    stored = ours.state_dict()
    for name, b in model.model.named_buffers():
        assert torch.equal(b, stored[name]) if name in stored else not b.any(), name
    shutil.copytree(hf_dir, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.blocks.1.mlp_norm.weight"]
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(load(tmp_path / "hf").model.blocks["1"].mlp_norm.weight, torch.ones(ours.cfg.d_model))


def test_sharded_weights_load_both_ways(spm, tmp_path):
    from kimi.convert import load_hf
    from kimi.interop.remote import save_remote
    from kimi.model import KimiModel

    torch.manual_seed(0)
    ours = fill_randomly(KimiModel(tiny_model_cfg(vocab_size=spm.vocab_size, moe=dict(num_experts=4))),
                         std=0.2).eval()
    files = save_remote(ours, tmp_path / "hf", shard_bytes=2**15)
    assert sum(f.endswith(".safetensors") for f in files) > 2
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    tokens = torch.randint(3, spm.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path / "hf")(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)
    back = load_hf(tmp_path / "hf").state_dict()
    assert all(torch.equal(back[k], t) for k, t in ours.state_dict().items())


def test_autotokenizer_encodes_like_ours(exported, spm):
    from transformers import AutoTokenizer

    # trust_remote_code for the config.json beside it (the tokenizer itself runs no code of ours)
    tokenizer = AutoTokenizer.from_pretrained(exported[2], trust_remote_code=True)
    for text in TEXTS:
        ids = spm.encode(text)
        assert tokenizer(text).input_ids == ids, text
        assert tokenizer.decode(ids) == text
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (spm.eos_id, spm.bos_id)


def test_from_hf_reads_the_export_back_bit_for_bit(exported, spm, tmp_path):
    """from-hf and load_hf: the same settings and tensors, also from what transformers' save_pretrained
    writes of the loaded model; the run's tokenizer comes back too."""
    from kimi.convert import load_hf, main
    from kimi.generate import load_from_checkpoint

    ours, run, hf_dir, _ = exported
    assert main(["from-hf", str(hf_dir), str(tmp_path / "back")]) == 0
    back, tokenizer, _ = load_from_checkpoint(str(tmp_path / "back"))
    theirs(hf_dir).save_pretrained(tmp_path / "saved")  # transformers writes the same layout back
    for model in (back, load_hf(hf_dir), load_hf(tmp_path / "saved")):
        assert model.cfg == ours.cfg
        state, mine = model.state_dict(), ours.state_dict()
        assert state.keys() == mine.keys()
        assert [k for k in mine if not torch.equal(state[k], mine[k])] == []
    assert tokenizer.sha256 == spm.sha256


def _imports(node):
    """The import statements under `node`, but those inside a try (which transformers' loader, too, lets
    fail)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not isinstance(child, ast.Try):
            yield from _imports(child)


def test_the_exported_code_imports_torch_and_transformers_only(exported):
    """No file imports kimi (relative imports only), omegaconf, hydra or triton: it runs where kimi is not
    installed. transformers' loader reaches every file from modeling_kimi.py by the relative imports it reads
    (it copies only those into its module cache; kimi/model/registry.py imports some by name)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    reached = {p.rpartition("/")[2] for p in get_relative_import_files(str(exported[2] / "modeling_kimi.py"))}
    assert reached | {"modeling_kimi.py"} == {p.name for p in exported[2].glob("*.py")}
    libraries = {"torch", "transformers"} | set(sys.stdlib_module_names)
    for path in sorted(exported[2].glob("*.py")):
        for node in _imports(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if not getattr(node, "level", 0):
                assert {n.split(".")[0] for n in names} <= libraries, (path.name, ast.unparse(node))


@pytest.mark.slow
def test_the_export_runs_where_kimi_omegaconf_hydra_and_triton_are_missing(exported):
    """In a process where importing kimi, omegaconf, hydra or triton fails, transformers loads the export and
    decodes as ours does (a subprocess: about 6 s of CPU, most of it importing transformers)."""
    import os
    import subprocess

    from kimi.model.decode import generate

    ours, _, hf_dir, _ = exported
    # eos_token_id=-1: no stop at the run's EOS, as ours without eos_id
    script = ("import sys\n"
              "for name in ('kimi', 'omegaconf', 'hydra', 'triton'):\n"
              "    sys.modules[name] = None\n"
              "import torch\n"
              "from transformers import AutoModelForCausalLM\n"
              "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
              "ids = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, "
              "eos_token_id=-1)\n"
              "print(ids[0, 3:].tolist())\n")
    out = subprocess.run([sys.executable, "-c", script, str(hf_dir)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(generate(ours, [5, 6, 7], 4, temperature=0))


def test_triton_asked_for_falls_back_to_the_pytorch_path(exported):
    """Where Triton would run (CUDA), the export, which carries no Triton kernels, runs PyTorch's path."""
    ours, _, hf_dir, _ = exported
    model = theirs(hf_dir)
    dispatch = sys.modules[type(model).__module__.rpartition(".")[0] + ".ops_dispatch"]
    tokens = torch.randint(3, ours.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with pytest.MonkeyPatch.context() as mp, pytest.warns(RuntimeWarning, match="falling back"):
        mp.setattr(dispatch, "AUTO_TRITON_ON_CPU", True)
        with torch.no_grad():
            torch.testing.assert_close(model(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)
    dispatch.reset()


def test_padding_and_embeddings_are_refused(exported):
    model = theirs(exported[2])
    with pytest.raises(ValueError, match="without padding"):
        model(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="not inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 4, model.config.hidden_size))


@pytest.mark.parametrize("kind", ["tiktoken", "tokenizer.json"])
def test_other_tokenizer_kinds_load_in_autotokenizer(kind, spm, tmp_path):
    """Kimi's tiktoken BPE (its special tokens after the ranks) and a tokenizer.json travel as well; the
    run's own file (or tokenizer.json) in the export is the same tokenizer to from-hf."""
    from transformers import AutoTokenizer

    from kimi.data import Tokenizer
    from kimi.interop.tokenizer_files import write_tokenizer

    if kind == "tiktoken":
        ours = Tokenizer(write_kimi_tiktoken(tmp_path / "tik"))
    else:  # a tokenizer.json (with the config naming its EOS) as written for the sentencepiece one
        (tmp_path / "json").mkdir()
        write_tokenizer(spm, tmp_path / "json")
        ours = Tokenizer(tmp_path / "json" / "tokenizer.json")
    (tmp_path / "out").mkdir()
    files = write_tokenizer(ours, tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS:
        assert tokenizer(text).input_ids == ours.encode(text), text
        assert tokenizer.decode(ours.encode(text)) == text
    assert tokenizer.eos_token_id == ours.eos_id
    # from-hf's pick
    copied = next(f for f in ("tiktoken.model", "tokenizer.model", "tokenizer.json") if f in files)
    assert Tokenizer(tmp_path / "out" / copied).sha256 == ours.sha256


def test_a_kimi_linear_model_stays_native_with_its_tokenizer(spm, tmp_path, capsys):
    """What transformers' own class expresses is written for it, as before, now with the tokenizer; with
    remote_code=true it is written with our modeling code instead, which runs our forward."""
    from kimi.convert import main

    cfg = tiny_model_cfg(vocab_size=spm.vocab_size, residual="standard", kda=dict(gate_bias=False),
                         mla=dict(rotary=False))
    ours = make_run(tmp_path / "run", cfg, spm)
    assert main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "kimi_linear"
    assert not (tmp_path / "hf" / "modeling_kimi.py").exists()
    assert ((tmp_path / "hf" / "tokenizer.json").is_file()
            and "KimiLinearForCausalLM" in capsys.readouterr().out)
    assert main(["to-hf", f"run={tmp_path / 'run'}", f"out={tmp_path / 'remote'}", "remote_code=true"]) == 0
    tokens = torch.randint(3, spm.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path / "remote")(tokens).logits, ours(tokens), atol=1e-4,
                                   rtol=1e-4)
    capsys.readouterr()
    assert main(["to-hf", str(tmp_path / "run"), str(tmp_path / "x"), "--remote-code",
                 "--mxfp4-experts"]) == 2
    assert "remote_code=true" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_other_layouts_still_refuse_what_they_cannot_express(exported, tmp_path, capsys):
    from kimi.convert import main

    assert main(["to-hf", str(exported[1]), str(tmp_path / "hf"), "--layout", "save_pretrained"]) == 2
    assert "model.residual=attnres_block" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_missing_converter_package_is_named_before_anything_is_written(exported, tmp_path, capsys,
                                                                         monkeypatch):
    import importlib.util

    from kimi.convert import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert main(["to-hf", str(exported[1]), str(tmp_path / "hf")]) == 2
    assert "pip install transformers" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_a_config_of_another_kimi_is_a_one_line_error(exported, tmp_path):
    import shutil

    from kimi.convert import load_hf

    copy = tmp_path / "hf"
    shutil.copytree(exported[2], copy)
    config = json.loads((copy / "config.json").read_text())
    config["kimi_model"]["from_the_future"] = 1
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unknown: \['from_the_future'\]") as e:
        load_hf(copy)
    assert "\n" not in str(e.value)
