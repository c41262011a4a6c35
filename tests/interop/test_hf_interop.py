"""kimi.interop.hf against transformers' Kimi Linear (an independent definition of the architecture): the
48B-A3B preset has exactly the parameters KimiLinearForCausalLM has for the same config, built on the
meta device; configs map both ways; what transformers cannot express is refused by name."""

import dataclasses

import pytest
import torch

from helpers import ROOT, tiny_model_cfg
from kimi.config import ModelConfig
from kimi.interop.hf import NotExpressible, hf_config, model_fields, release_config
from kimi.schema.vocabulary import value_at
from kimi.summary import compose_config, summarize

hf_model = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                               reason="transformers (dev extra) not installed")
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig  # noqa: E402


@pytest.mark.unit
def test_48b_a3b_counts_equal_transformers():
    s = summarize(compose_config(["model=kimi_linear_48b_a3b"]))
    with torch.device("meta"):
        theirs = hf_model.KimiLinearForCausalLM(KimiLinearConfig(**hf_config(s.cfg.model)))
    total = sum(p.numel() for p in theirs.parameters())
    experts = [e for e in theirs.modules() if isinstance(e, hf_model.KimiLinearExperts)]
    per_expert = [e.gate_up_proj[0].numel() + e.down_proj[0].numel() for e in experts]
    inactive = sum((e.gate_up_proj.shape[0] - s.cfg.model.moe.top_k) * n for e, n in zip(experts, per_expert))
    assert (s.total, s.active) == (total, total - inactive)
    assert 49.0e9 < s.total < 49.2e9 and 3.4e9 < s.active < 3.5e9


def dotted(fields: dict, prefix: str = ""):
    """(dotted key, value) of ModelConfig fields whose sections are dicts (model_fields' form)."""
    for key, value in fields.items():
        if isinstance(value, dict):
            yield from dotted(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


@pytest.mark.unit
def test_configs_map_both_ways():
    m = ModelConfig(**{**dataclasses.asdict(compose_config(["model=kimi_linear_48b_a3b"]).model)})
    back = model_fields(KimiLinearConfig(**hf_config(m)).to_dict())
    for key, value in dotted(back):
        assert value_at(m, key) == value, key
    release = release_config(m)  # the released config.json's layout, read by us and by transformers alike
    assert release["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 27]  # as released
    for layout in (release, KimiLinearConfig(**release).to_dict()):
        assert all(value_at(m, key) == value for key, value in dotted(model_fields(layout)))
    small = tiny_model_cfg(residual="standard", kda=dict(gate_bias=False),
                           mla=dict(q_lora_rank=8, qk_rope_head_dim=8, rotary=False),
                           moe=dict(num_experts=4, top_k=2, groups=2, topk_groups=1))
    again = model_fields(KimiLinearConfig(**hf_config(small)).to_dict())
    assert all(value_at(small, k) == v for k, v in dotted(again) if k not in ("mla_layers", "mla.norm_eps"))
    assert again["mla_layers"] == [1]


REFUSED = [(dict(residual="attnres_block"), "model.residual"),
           (dict(residual="standard", kda=dict(gate_bias=True)), "model.kda.gate_bias"),
           (dict(residual="standard", kda=dict(gate_bias=False), mla=dict(qk_rope_head_dim=8, rotary=True)),
            "model.mla.rotary")]


@pytest.mark.unit
@pytest.mark.parametrize("overrides,key", REFUSED)
def test_what_transformers_cannot_express_is_refused_by_name(overrides, key):
    with pytest.raises(NotExpressible, match=key):
        hf_config(tiny_model_cfg(**overrides))


@pytest.fixture
def torch_kda(monkeypatch):
    """transformers routes KDA to fla-core's GPU kernels when fla is importable (decided at import): use
    its PyTorch path, which runs on CPU."""
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        fn = getattr(hf_model, name)
        monkeypatch.setattr(hf_model, name, getattr(fn, "__wrapped__", fn))


def small_hf_config(**overrides):
    base = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, intermediate_size=48,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=2,
                linear_head_dim=16, linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=2,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None,
                num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                n_group=4, topk_group=2, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
                tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return KimiLinearConfig(**{**base, **overrides})


def random_hf(config):
    torch.manual_seed(0)
    model = hf_model.KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.linspace(-0.1, 0.1, buf.numel()))
    return model


TOKENS = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(1))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def file_tensors(directory):
    """Every tensor of a safetensors directory (one file or shards), by name."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.unit
@pytest.mark.parametrize("q_lora", [None, 12])
def test_logits_equal_transformers_after_conversion(torch_kda, tmp_path, q_lora):
    """A random transformers Kimi Linear (KDA + MLA with unrotated shared key dims, a dense first block, MoE
    with grouped routing and a non-zero correction bias), saved and loaded as ours: our logits equal its in
    fp32; and saved back by us in save_pretrained's layout, the same tensors under the same names."""
    from kimi.convert import load_hf, save_hf

    theirs = random_hf(small_hf_config(q_lora_rank=q_lora))
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    with torch.no_grad():
        assert rel(ours(TOKENS), theirs(TOKENS).logits) < 1e-5  # measured 1.2e-6
    save_hf(ours, tmp_path / "back", layout="save_pretrained")
    written, original = file_tensors(tmp_path / "back"), file_tensors(tmp_path / "hf")
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in written)


@pytest.mark.unit
def test_load_hf_reads_a_transformers_directory(torch_kda, tmp_path):
    """save_pretrained (sharded) -> kimi.convert.load_hf: the same logits."""
    from kimi.convert import load_hf

    theirs = random_hf(small_hf_config())
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_hf(tmp_path / "hf")
    with torch.no_grad():
        assert rel(ours(TOKENS), theirs(TOKENS).logits) < 1e-5


@pytest.mark.unit
def test_save_hf_loads_in_transformers(torch_kda, tmp_path):
    """ours -> kimi.convert.save_hf (sharded) -> AutoModelForCausalLM.from_pretrained: the same logits."""
    from transformers import AutoModelForCausalLM

    from kimi.convert import load_hf, save_hf

    theirs = random_hf(small_hf_config(q_lora_rank=12))
    theirs.save_pretrained(tmp_path / "src")
    ours = load_hf(tmp_path / "src")
    save_hf(ours, tmp_path / "out", shard_bytes=200_000)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again).__name__ == "KimiLinearForCausalLM"
    with torch.no_grad():
        assert rel(again(TOKENS).logits, ours(TOKENS)) < 1e-5


KIMI_LINEAR_LIKE = ["model.residual=standard", "model.kda.gate_bias=false", "model.mla.qk_rope_head_dim=8",
                    "model.mla.rotary=false", "model.moe.num_experts=4", "model.moe.top_k=2",
                    "model.moe.hidden=16", "model.moe.groups=2", "model.moe.topk_groups=1",
                    "model.mla.norm_eps=1e-6"]


@pytest.mark.e2e
def test_to_hf_command_writes_what_transformers_loads(torch_kda, tmp_path, data, capsys):
    """A trained run (KDA, MLA with unrotated shared dims, MoE) -> python -m kimi.convert to-hf ->
    AutoModelForCausalLM: the same logits as the run's model; a default run (Attention Residuals) is
    refused by save_pretrained's layout, naming the setting, exit code 2 (the default layout writes it with
    its own modeling code: tests/interop/test_export_remote.py)."""
    from helpers import train_run
    from transformers import AutoModelForCausalLM

    from kimi.convert import main
    from kimi.generate import load_from_checkpoint

    run = tmp_path / "run"
    train_run(run, data, "trainer.max_steps=2", *KIMI_LINEAR_LIKE)
    assert main(["to-hf", str(run), str(tmp_path / "hf")]) == 0
    ours, _, _ = load_from_checkpoint(str(run))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(theirs(tokens).logits, ours(tokens)) < 1e-5
    default = tmp_path / "default"
    train_run(default, data, "trainer.max_steps=1")
    capsys.readouterr()
    assert main(["to-hf", str(default), str(tmp_path / "refused"), "--layout", "save_pretrained"]) == 2
    assert "model.residual=attnres_block" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


@pytest.mark.unit
def test_decoding_equals_transformers_generate_with_cache(torch_kda, tmp_path):
    """Prefill then token by token through each side's cache (KDA state and conv tails, MLA latents): every
    step's logits agree, so greedy decoding picks the same tokens."""
    from kimi.convert import load_hf

    theirs = random_hf(small_hf_config())
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    prompt = TOKENS[:1, :37]
    with torch.no_grad():
        # every prompt token is real: without the mask generate would take token 0 for padding
        out = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                              do_sample=False, use_cache=True, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        new = out.sequences[0, prompt.shape[1]:]
        cache = ours.new_cache()
        logits = ours(prompt, cache=cache)[0, -1]
        for step, token in enumerate(new.tolist()):
            assert rel(logits, out.logits[step][0]) < 1e-5, step
            assert int(logits.argmax()) == token
            logits = ours(torch.tensor([[token]]), cache=cache)[0, -1]


@pytest.mark.dist
def test_to_hf_from_a_sharded_run(torch_kda, tmp_path, data):
    """A run trained with FSDP over 2 ranks (its checkpoint sharded) converts like a one-process run:
    the checkpoint is read into one model whatever layout wrote it."""
    from helpers import TINY_TRAINER
    from layout_runs import torchrun
    from transformers import AutoModelForCausalLM

    from kimi.convert import main
    from kimi.generate import load_from_checkpoint

    run = tmp_path / "fsdp"
    torchrun(2, run, [*TINY_TRAINER, *data, "trainer.max_steps=2", "trainer.eval_every=0",
                      "parallel.dp_shard=2", "trainer.micro_batch_size=2", *KIMI_LINEAR_LIKE])
    assert main(["to-hf", str(run), str(tmp_path / "hf")]) == 0
    ours, _, step = load_from_checkpoint(str(run))
    assert step == 2
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel(theirs(tokens).logits, ours(tokens)) < 1e-5


@pytest.mark.e2e
def test_from_hf_makes_a_run_that_samples_and_trains_from_the_weights(torch_kda, tmp_path, data, capsys):
    """python -m kimi.convert from-hf on a transformers directory with a sentencepiece tokenizer: the run dir
    samples with kimi.generate from exactly transformers' model, and the printed train.py command starts
    training from those weights (at a learning rate too small to move them: after a step the weights are
    still transformers')."""
    import subprocess
    import sys

    import sentencepiece as spm

    from kimi.convert import main
    from kimi.generate import load_from_checkpoint
    from kimi.model.decode import generate

    theirs = random_hf(small_hf_config(vocab_size=512))
    hf = tmp_path / "hf"
    theirs.save_pretrained(hf)
    text = [f"line {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(300)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(hf / "tokenizer"),
                                   vocab_size=200, model_type="bpe", minloglevel=2)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["from-hf", str(hf), str(run)]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1].split("train from it: ")[1]
    assert f"--config-dir {run} model=hf hydra.run.dir={run}" in command

    ours, tokenizer, step = load_from_checkpoint(str(run))
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert step == 0 and rel(ours(tokens), theirs(tokens).logits) < 1e-5
    assert len(generate(ours, tokenizer.encode("the quick"), 5, temperature=0)) == 5
    assert main(["from-hf", str(hf), str(run)]) == 2  # never over an existing run

    from helpers import TINY_TRAINER

    train = [t for t in TINY_TRAINER if not t.startswith(("model.", "data.tokenizer"))]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *command.split()[2:], *train, *data,
                           "trainer.max_steps=1", "trainer.eval_every=0", "optim.lr=1e-12"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"[kimi] weights from {run / 'init'}" in proc.stdout
    trained, _, step = load_from_checkpoint(str(run))
    assert step == 1
    moved = ours.state_dict()
    for name, tensor in trained.state_dict().items():  # the routers' balancing biases move by design
        if not name.endswith("expert_bias"):
            torch.testing.assert_close(tensor, moved[name], rtol=0, atol=1e-9, msg=name)

    from helpers import run_cfg

    from kimi.config import ConfigError
    from kimi.trainer import Trainer

    with pytest.raises(ConfigError,
                       match=r"cannot start from the weights in .*step_00000001: the model differs"):
        Trainer(run_cfg(tmp_path / "other", data, f"trainer.init_from={run}"))  # the tiny model, not these


@pytest.mark.unit
def test_from_hf_carries_a_kimi_release_tiktoken_tokenizer(torch_kda, tmp_path, capsys):
    """A directory laid out like Kimi's releases (tiktoken.model + tokenizer_config.json): the run dir gets
    both, kimi.generate reads them, and a model whose vocabulary cannot hold the tokenizer is refused before
    anything is written."""
    from helpers import write_kimi_tiktoken

    from kimi.convert import from_hf, main
    from kimi.data import Tokenizer
    from kimi.generate import load_from_checkpoint
    from kimi.model.decode import generate

    source = Tokenizer(write_kimi_tiktoken(tmp_path / "hf"))
    random_hf(small_hf_config(vocab_size=source.vocab_size)).save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["from-hf", str(tmp_path / "hf"), str(run)]) == 0
    assert f"data.tokenizer.model_path={run / 'tokenizer.model'}" in capsys.readouterr().out
    model, tokenizer, _ = load_from_checkpoint(str(run))
    assert (tokenizer.kind, tokenizer.sha256, tokenizer.eos_id) == ("tiktoken", source.sha256, source.eos_id)
    prompt = tokenizer.encode("月之暗面的模型Kimi")
    assert len(generate(model, prompt, 4, temperature=0)) == 4

    random_hf(small_hf_config(vocab_size=source.vocab_size - 1)).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=f"has {source.vocab_size} tokens, more than the model's vocabulary"):
        from_hf(tmp_path / "hf", tmp_path / "small")
    assert not (tmp_path / "small").exists()
