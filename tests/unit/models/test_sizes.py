"""Named sizes in conf/model/, meta-device construction, parameter and FLOP accounting."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from dsrun.models import (GPT, build_model, forward_flops, gpt_config, largest_layer_params, model_names,
                          num_parameters, train_step_flops)
from dsrun.utils.errors import ConfigError
from dsrun.utils.paths import conf_dir

EXPECTED_SIZES = ["gpt-1.3b", "gpt-13b", "gpt-2.7b", "gpt-6.7b", "gpt-large", "gpt-medium", "gpt-micro",
                  "gpt-mini", "gpt-nano", "gpt-small", "gpt-xl"]


def test_every_named_size_ships_and_instantiates_with_hydra_on_meta():
    assert model_names() == EXPECTED_SIZES
    for name in EXPECTED_SIZES:
        path = conf_dir() / "model" / f"{name}.yaml"
        assert path.read_text().startswith("# @package model\n"), name
        cfg = OmegaConf.load(path)
        assert cfg._target_ == "dsrun.models.gpt.GPT"
        with torch.device("meta"):
            model = instantiate(cfg)
        assert isinstance(model, GPT)
        assert all(p.is_meta for p in model.parameters()), name
        assert num_parameters(model) == model.config.num_parameters(), name
        assert num_parameters(model, exclude_embeddings=True) == model.config.num_parameters(True), name
        assert largest_layer_params(model) == model.config.largest_layer_params(), name


def test_gpt_small_is_gpt2_124m():
    # The published GPT-2 small count (tied embeddings, learned positions, biases).
    assert gpt_config("gpt-small").num_parameters() == 124_439_808


def test_gpt_nano_is_a_few_hundred_thousand_byte_level_parameters():
    config = gpt_config("gpt-nano")
    assert config.vocab_size == 256
    assert 100_000 < config.num_parameters() < 1_000_000


def test_gpt_13b_on_meta_matches_the_closed_form_count():
    model = build_model("gpt-13b", device="meta")
    layers, width, vocab, context = 40, 5120, 50257, 2048
    closed_form = (12 * layers * width**2      # attention (4d²) and MLP (8d²) weights
                   + 13 * layers * width       # 9d linear biases + 4d LayerNorm weights and biases
                   + 2 * width                 # final LayerNorm
                   + vocab * width             # token table, tied to the output head
                   + context * width)          # learned positions
    assert num_parameters(model) == closed_form == 12_853_386_240
    assert all(p.is_meta for p in model.parameters())
    assert largest_layer_params(model) == vocab * width


def test_shared_parameters_are_counted_once_even_on_meta():
    # data_ptr() is 0 for every meta tensor, so counting by pointer would be wrong here.
    model = build_model("gpt-nano", device="meta")
    naive = sum(p.numel() for p in model.state_dict().values())
    config = model.config
    assert naive - num_parameters(model) == config.vocab_size * config.n_embd  # the head's duplicate entry


def test_build_model_accepts_overrides_and_user_targets():
    model = build_model("gpt-small", device="meta", vocab_size=256)
    assert model.config.vocab_size == 256
    user = build_model({"_target_": "torch.nn.Linear", "in_features": 4, "out_features": 3})
    assert isinstance(user, torch.nn.Linear) and num_parameters(user) == 15
    with pytest.raises(ConfigError, match="did you mean 'gpt-nano'"):
        build_model("gpt-nan")
    with pytest.raises(ConfigError, match="cannot build 'no_such_pkg.Model'"):
        build_model({"_target_": "no_such_pkg.Model"})


def test_forward_flops_formula_and_agreement_with_torch_flop_counter():
    config = gpt_config("gpt-small")
    tokens = 2 * 1024
    n_matmul = 12 * 12 * 768**2 + 50257 * 768
    attention = 4 * 12 * 1024 * 768 * tokens
    assert forward_flops(config, 2, 1024) == 2 * n_matmul * tokens + attention
    assert train_step_flops(config, 2, 1024) == 3 * forward_flops(config, 2, 1024)
    # checkpointing runs the blocks' forward again (not the head); selective only their QKV projections
    blocks = 12 * (2 * 12 * 768**2 + 4 * 1024 * 768) * tokens
    three = 3 * forward_flops(config, 2, 1024)
    assert train_step_flops(config, 2, 1024, activation_checkpointing=True) == three + blocks
    assert train_step_flops(config, 2, 1024, activation_checkpointing="every_2") == three + blocks // 2
    assert train_step_flops(config, 2, 1024, activation_checkpointing="selective") == \
        three + 12 * 2 * 3 * 768**2 * tokens

    model = GPT(gpt_config("gpt-nano"))
    batch, seq = 2, 64
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 256, (batch, seq)))
    cfg = model.config
    attention_term = 4 * cfg.n_layer * seq * cfg.n_embd * batch * seq
    # Every matmul is counted exactly; torch counts the CPU attention kernel only on some versions.
    assert counter.get_total_flops() in (forward_flops(model, batch, seq),
                                         forward_flops(model, batch, seq) - attention_term)


def test_the_docs_size_table_matches_the_models():
    from tests.helpers import REPO

    rows = {}
    for line in (REPO / "docs" / "models.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0].startswith("`gpt-"):
            rows[cells[0].strip("`")] = cells
    assert sorted(rows) == EXPECTED_SIZES
    for name, cells in rows.items():
        config = gpt_config(name)
        assert int(cells[6].split()[0].replace(",", "")) == config.num_parameters(), name
        assert int(cells[7].replace(",", "")) == config.num_parameters(exclude_embeddings=True), name
        assert int(cells[8].replace(",", "")) == config.largest_layer_params(), name


def test_hydra_composes_model_and_data_groups_together(tmp_path):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(overrides=["+model=gpt-micro", "+data=pystdlib", "model.positions=rotary",
                                 "data.max_bytes=60000", f"data.cache_dir={tmp_path}"])
    model = instantiate(cfg.model)
    corpus = instantiate(cfg.data)
    assert model.config.positions == "rotary" and corpus.seq_len == model.config.block_size == 256
    inputs, targets = next(corpus.train_loader(2))
    assert model(inputs, targets).ndim == 0
