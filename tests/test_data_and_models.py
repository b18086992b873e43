"""Embedded corpus, tokenizer, presets, pretrained loading and the memory probe."""

import os

import pytest
import torch
from transformers import LlamaForCausalLM

from cluster.max_batch_calculator import NodeShare, find_max_batch_size
from fabrics.corpus import load_corpus
from fabrics.dataset_loader import WHEEL_SHA256, fetch_wheel, parse_documents
from fabrics.models import build_model, load_preset
from tests.conftest import ROOT
from utils.errors import DataError, UserError


def test_parse_documents_in_each_files_convention():
    wiki = '<doc id="1" title="A">\nA\n\nText one.\n</doc>\n<doc id="2">Two</doc>'
    assert parse_documents("wiki", wiki) == ["A\n\nText one.", "Two"]
    assert parse_documents("tiny", "Once.<|endoftext|>Twice.\n<|endoftext|>  ") == ["Once.", "Twice."]
    assert parse_documents("c4", "page one\n\npage two\n") == ["page one", "page two"]


def test_embedded_corpus_split_tokenizer_and_holdout(tiny_config):
    cfg = tiny_config("embedded_sources=[wiki, c4, tiny]", "val_size=16")
    data = load_corpus(cfg)
    assert "BPE" in data.tokenizer.name_or_path and len(data.tokenizer) == 512
    assert len(data.val) == 16 and len(data.train) > 1000
    assert data.train.input_ids.shape[1] == 32
    train_rows = {tuple(r) for r in data.train.input_ids.tolist()}
    assert not any(tuple(r) in train_rows for r in data.val.input_ids.tolist())
    text = data.tokenizer.decode(data.train.input_ids[0])
    assert sum(c.isalpha() for c in text) > 10  # real English text, not noise
    assert torch.equal(load_corpus(cfg).train.input_ids, data.train.input_ids)  # cached tokenizer, same data


def test_wrong_wheel_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "exllamav2-0.3.2-py3-none-any.whl"
    fake.write_bytes(b"not the wheel")
    monkeypatch.setenv("ADLOCO_EXLLAMAV2_WHEEL", str(fake))
    with pytest.raises(DataError, match="sha256"):
        fetch_wheel(tmp_path)
    monkeypatch.setenv("ADLOCO_EXLLAMAV2_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(DataError, match="not found"):
        fetch_wheel(tmp_path)


def test_cached_wheel_is_verified(cache_dir, tiny_config):
    load_corpus(tiny_config())
    os.environ.pop("ADLOCO_EXLLAMAV2_WHEEL", None)
    assert fetch_wheel(cache_dir).name.startswith("exllamav2-0.3.2") and len(WHEEL_SHA256) == 64


def test_microllama_300m_preset_is_the_real_size():
    with torch.device("meta"):
        model = LlamaForCausalLM(load_preset("microllama-300m"))
    n = sum(p.numel() for p in model.parameters())
    assert 290e6 < n < 320e6
    assert model.config.num_key_value_heads == 4 and model.config.vocab_size == 32000


def test_microllama_nano_preset_has_the_documented_size():
    # docs/data_and_models.md and BENCHMARKS quote these counts (tokens per non-embedding parameter)
    with torch.device("meta"):
        model = LlamaForCausalLM(load_preset("microllama-nano"))
    n = sum(p.numel() for p in model.parameters())
    embeddings = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    assert (n, n - embeddings) == (616_768, 92_480)


def test_presets_build_seeded_and_identical(tiny_config):
    cfg = tiny_config()
    a, b = build_model(cfg, 512, 1), build_model(cfg, 512, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_model(tiny_config("training_seed=7"), 512, 1)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_pretrained_missing_fails_fast_without_network(tiny_config, tmp_path):
    cfg = tiny_config(f"model_config.name={tmp_path / 'nowhere'}", "model_config.pretrained=true")
    with pytest.raises(UserError, match="cannot load pretrained weights"):
        build_model(cfg, 512, 1)
    with pytest.raises(UserError, match="neither a preset"):
        build_model(tiny_config("model_config.name=microllama-huge"), 512, 1)


def test_cpu_memory_probe_grows_with_budget_and_refuses_too_small(tiny_config):
    model = build_model(tiny_config(), 512, 1)

    def probe(mb):
        return find_max_batch_size(model, lambda p: torch.optim.AdamW(p), "cpu", 32, NodeShare(1.0, 1, memory_mb=mb),
                                   upper=64)

    small, large = probe(20), probe(60)
    assert 1 <= small < large <= 64
    with pytest.raises(UserError, match="device_memory_mb: not even one sequence"):
        probe(1)


def test_simulated_cuda_devices_on_one_card_share_its_memory():
    """The 16-node reading of the paper's cluster simulates 4 GPUs on one card with 4 nodes each: every one of the 16
    nodes gets a sixteenth of the card's free memory (not a quarter, as if each simulated device owned the card), and
    a device's own memory_mb caps its nodes' share. The authors' reading: 4 nodes on the card, a quarter each."""
    from cluster.max_batch_calculator import MiB, NodeShare
    from cluster.placement import nodes_on_card
    from utils.config import load_config

    paper = load_config(ROOT / "configs" / "paper_microllama_c4_16nodes.yaml")
    assert (paper.total_nodes, paper.num_init_trainers, nodes_on_card(paper, "cuda:0")) == (16, 4, 16)
    authors = load_config(ROOT / "configs" / "paper_microllama_c4.yaml")
    assert (authors.total_nodes, authors.num_init_trainers, nodes_on_card(authors, "cuda:0")) == (4, 4, 4)
    two_cards = load_config(None, ["devices=[cuda, cuda:0, cuda:1]", "nodes_per_gpu=2"])
    assert nodes_on_card(two_cards, "cuda:0") == 4 and nodes_on_card(two_cards, "cuda:1") == 2
    gib = 1 << 30
    assert NodeShare(0.9, 4, nodes_on_card=16).cuda_bytes(80 * gib) == 0.9 * 80 * gib / 16  # 4.5 GiB a node
    capped = NodeShare(0.9, 4, memory_mb=10_000, nodes_on_card=16)
    assert capped.cuda_bytes(80 * gib) == 0.9 * 10_000 * MiB / 4  # the device's cap
    assert NodeShare(0.9, 4, memory_mb=80_000, nodes_on_card=16).cuda_bytes(80 * gib) == 0.9 * 80 * gib / 16
    assert NodeShare(0.9, 4).cuda_bytes(80 * gib) == 0.9 * 80 * gib / 4  # nodes_on_card 0: this device's nodes


def test_the_packed_corpus_is_cached_and_rebuilt_when_anything_defining_it_changes(tiny_config, cache_dir, tmp_path,
                                                                                   monkeypatch, caplog):
    import shutil

    from fabrics import dataset_loader

    own_cache = tmp_path / "cache"  # the session's wheel and tokenizers, without its packed corpora
    shutil.copytree(cache_dir, own_cache, ignore=shutil.ignore_patterns("packed"))
    packs = []
    original = dataset_loader.tokenize_and_pack
    monkeypatch.setattr(dataset_loader, "tokenize_and_pack", lambda *a, **k: packs.append(1) or original(*a, **k))

    def load(*overrides):
        packs.clear()
        return load_corpus(tiny_config(f"cache_dir={own_cache}", *overrides))

    first = load()
    assert packs and len(list((own_cache / "packed").glob("*.pt"))) == 1
    caplog.clear()
    with caplog.at_level("INFO", logger="fabrics.dataset_loader"):
        second = load()
    assert not packs and "came from the cache" in caplog.text
    for a, b in ((first.train, second.train), (first.val, second.val)):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
        assert torch.equal(a.tokens_per_sequence, b.tokens_per_sequence)
    # seq_len, the documents (another shuffle, another source) and the tokenizer each make a new entry
    for change in ("seq_len=64", "training_seed=7", "embedded_sources=[tiny, wiki]", "tokenizer_vocab_size=600"):
        load(change)
        assert packs, change
    assert len(list((own_cache / "packed").glob("*.pt"))) == 5
    # a damaged entry is rebuilt, not trusted
    (entry,) = [p for p in (own_cache / "packed").glob("*.pt")
                if dataset_loader.load_packed(p)[0].input_ids.shape == first.train.input_ids.shape
                and torch.equal(dataset_loader.load_packed(p)[0].input_ids, first.train.input_ids)]
    entry.write_bytes(b"not a torch file")
    third = load()
    assert packs and torch.equal(third.train.input_ids, first.train.input_ids)
