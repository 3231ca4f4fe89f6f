import json
import math

import pytest
import torch

from slmedge.data.calibration import load_calibration
from slmedge.errors import DataError
from slmedge.evaluate.corpora import load_corpus
from slmedge.evaluate.perplexity import perplexity
from tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_text_and_jsonl_calibration_same_seed_same_tokens(tok, tmp_path, calib_file):
    a = load_calibration(str(calib_file), tok, 5, 16, seed=1)
    b = load_calibration(str(calib_file), tok, 5, 16, seed=1)
    c = load_calibration(str(calib_file), tok, 5, 16, seed=2)
    assert a.tokens.shape == (5, 16) and torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert a.identity["tokens_sha256"] == b.identity["tokens_sha256"]
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"body": line}) for line in calib_file.read_text().splitlines()))
    d = load_calibration(str(jl), tok, 5, 16, seed=1, text_field="body")
    assert d.tokens.shape == (5, 16)


def test_bad_calibration_data(tok, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError, match="one sample needs"):
        load_calibration(str(short), tok, 2, 64)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"other": 1}\n')
    with pytest.raises(DataError, match="no string field 'text'"):
        load_calibration(str(bad), tok, 2, 8)
    with pytest.raises(DataError, match="not found"):
        load_calibration("no-such-set", tok, 2, 8, data=tmp_path)


def test_shared_calibration_sets(tok):
    c4 = load_calibration("c4", tok, 4, 64, seed=0)
    assert c4.identity["files"] == {"calibration/c4_en.jsonl": c4.identity["files"]["calibration/c4_en.jsonl"]}
    de = load_calibration("multilingual:de,zh", tok, 4, 64, seed=0)
    assert len(de.identity["files"]) == 2
    with pytest.raises(DataError, match="no multilingual calibration text for xx"):
        load_calibration("multilingual:xx", tok, 4, 64)


def test_data_dir_option_and_environment(tmp_path, monkeypatch, tok):
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "c4_en.jsonl").write_text(json.dumps({"text": "hello world " * 200}) + "\n")
    monkeypatch.setenv("SLMEDGE_DATA_DIR", str(tmp_path))
    assert load_calibration("c4", tok, 2, 16).tokens.shape == (2, 16)
    monkeypatch.setenv("SLMEDGE_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(DataError, match="does not exist"):
        load_calibration("c4", tok, 2, 16)


def test_perplexity_matches_a_hand_computation(tok):
    model = tiny_model("llama")
    text = "Grüße aus München! 中文 text, then more words. " * 20
    res = perplexity(model, tok, text, seqlen=32, max_windows=3)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(3):
            window = torch.tensor(ids[w * 32 : (w + 1) * 32])
            logp = torch.log_softmax(model(window[None]).logits[0].double(), -1)
            for t in range(1, 32):
                total -= float(logp[t - 1, window[t]])
                count += 1
    assert res.tokens == count == 93 and res.windows == 3
    assert math.isclose(res.perplexity, math.exp(total / count), rel_tol=1e-5)
    # Bits per byte counts UTF-8 bytes (ü, 中 are several bytes), not characters.
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    expected_bytes = 0
    for w in range(3):
        a, b = enc["offset_mapping"][w * 32 + 1][0], enc["offset_mapping"][w * 32 + 31][1]
        expected_bytes += len(text[a:b].encode("utf-8"))
        assert len(text[a:b].encode("utf-8")) > len(text[a:b])
    assert res.bytes == expected_bytes
    assert math.isclose(res.bits_per_byte, total / math.log(2) / expected_bytes, rel_tol=1e-5)


def test_corpus_shorter_than_one_window(tok):
    with pytest.raises(DataError, match="shorter than one window"):
        perplexity(tiny_model("llama"), tok, "too short", seqlen=512)


def test_named_corpora():
    assert load_corpus("wikitext2").startswith(" = Robert Boulter = ") or len(load_corpus("wikitext2")) > 1_000_000
    assert len(load_corpus("de").splitlines()) == 1997
    with pytest.raises(DataError, match="unknown corpus"):
        load_corpus("klingon")
