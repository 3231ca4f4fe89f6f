import json
import math

import pytest
import torch

from slmedge.data.calibration import adds_bos, load_calibration, read_sources, token_stream
from slmedge.errors import DataError
from slmedge.fsutil import sha256_file
from slmedge.evaluate.corpora import load_corpus
from slmedge.evaluate.perplexity import perplexity
from tiny import bos_led_nll, bos_tokenizer, tiny_model, tiny_tokenizer


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


def _within(row: list[int], ids: list[int]) -> bool:
    n = len(row)
    return any(ids[i : i + n] == row for i in range(len(ids) - n + 1))


def test_a_single_stream_is_sampled_uniformly_by_the_seed(tok):
    # c4 (one stream): window starts drawn by random.Random(seed) over the whole stream, in order.
    import random

    (texts,), = read_sources("c4")[0]
    ids = token_stream(tok, texts)
    rng = random.Random(3)
    expected = [ids[s : s + 32] for s in (rng.randrange(0, len(ids) - 32 + 1) for _ in range(5))]
    assert load_calibration("c4", tok, 5, 32, seed=3).tokens.tolist() == expected


def test_a_tokenizer_that_adds_bos_gets_windows_led_by_bos(tok):
    # As the model sees text in use, and as llama-imatrix feeds it: BOS, then seqlen - 1 tokens of text
    # from the starts the seed draws. A tokenizer without BOS keeps windows of text alone.
    import random

    led_tok = bos_tokenizer()
    assert adds_bos(led_tok) and not adds_bos(tok)
    (texts,), = read_sources("c4")[0]
    ids = token_stream(tok, texts)
    assert token_stream(led_tok, texts) == ids  # the text's ids are the same; only the windows differ
    rng = random.Random(3)
    expected = [[led_tok.bos_token_id] + ids[s : s + 31] for s in (rng.randrange(0, len(ids) - 31 + 1) for _ in range(5))]
    led = load_calibration("c4", led_tok, 5, 32, seed=3)
    assert led.tokens.shape == (5, 32) and led.tokens.tolist() == expected
    plain = load_calibration("c4", tok, 5, 32, seed=3)
    assert led.identity["bos"] is True and plain.identity["bos"] is False
    assert led.identity["tokens_sha256"] != plain.identity["tokens_sha256"]  # what compressed with it is told apart
    mix = load_calibration("c4+multilingual:de,hi", led_tok, 6, 24, seed=0).tokens
    assert (mix[:, 0] == led_tok.bos_token_id).all() and (mix[:, 1:] != led_tok.bos_token_id).all()


def test_a_mix_and_the_languages_take_equal_turns(tok, tmp_path):
    # Hindi has many more tokens than German here, yet each language gets half of the windows; in a
    # mix, the parts alternate window by window (so AWQ's first windows already hold every part).
    groups, _ = read_sources("multilingual:de,hi")
    de, hi = (token_stream(tok, texts) for texts in groups[0])
    assert len(hi) > 1.5 * len(de)
    rows = load_calibration("multilingual:de,hi", tok, 8, 24, seed=0).tokens.tolist()
    assert [_within(r, de) for r in rows] == [True, False] * 4 and all(_within(r, hi) for r in rows[1::2])

    own = tmp_path / "own+notes.txt"  # a file whose name has a + is a file, not a mix
    own.write_text("\n".join(f"line {i} of my own calibration text, about sensors and phones" for i in range(200)))
    # recorded for others by its name (an absolute path given), with its sha256: never the local path
    ident = load_calibration(str(own), tok, 2, 16).identity
    assert ident["files"] == {own.name: sha256_file(own)} and ident["spec"] == own.name
    mix = load_calibration(f"c4+multilingual:de,zh+{own}", tok, 7, 16, seed=1)
    (c4,), (de2, zh), (mine,) = ([token_stream(tok, t) for t in g] for g in read_sources(f"c4+multilingual:de,zh+{own}")[0])
    rows = mix.tokens.tolist()
    assert [_within(r, s) for r, s in zip(rows, [c4, de2, mine, c4, zh, mine, c4])] == [True] * 7
    assert set(mix.identity["files"]) == {"calibration/c4_en.jsonl", "calibration/multilingual/de.txt",
                                          "calibration/multilingual/zh.txt", own.name}
    assert mix.identity["spec"] == f"c4+multilingual:de,zh+{own.name}"
    assert not torch.equal(mix.tokens, load_calibration(f"multilingual:de,zh+c4+{own}", tok, 7, 16, seed=1).tokens)


def test_a_bad_mix_names_its_part(tok):
    from slmedge.errors import UnknownDataError

    with pytest.raises(UnknownDataError, match="empty part"):
        load_calibration("c4+", tok, 2, 16)
    with pytest.raises(UnknownDataError, match="'nope' not found"):
        load_calibration("c4+nope", tok, 2, 16)
    with pytest.raises(DataError, match="no multilingual calibration text for xx"):
        load_calibration("c4+multilingual:xx", tok, 2, 16)
    with pytest.raises(DataError, match="calibration file /no/such.txt does not exist"):
        load_calibration("c4+/no/such.txt", tok, 2, 16)


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


def test_torch_perplexity_puts_bos_first_for_a_tokenizer_that_adds_it(tok):
    model = tiny_model("llama")
    led_tok = bos_tokenizer()
    text = "Grüße aus München! 中文 text, then more words. " * 20
    res = perplexity(model, led_tok, text, seqlen=32, max_windows=2)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    total = bos_led_nll(model, led_tok.bos_token_id, ids, 31, 2)
    assert res.tokens == 2 * 31 and math.isclose(res.perplexity, math.exp(total / 62), rel_tol=1e-5)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert res.bytes == len(text[: enc["offset_mapping"][61][1]].encode("utf-8"))  # from the first text token


def test_corpus_shorter_than_one_window(tok):
    with pytest.raises(DataError, match="shorter than one window"):
        perplexity(tiny_model("llama"), tok, "too short", seqlen=512)


def test_named_corpora():
    assert load_corpus("wikitext2").startswith(" = Robert Boulter = ") or len(load_corpus("wikitext2")) > 1_000_000
    assert len(load_corpus("de").splitlines()) == 1997
    with pytest.raises(DataError, match="unknown corpus"):
        load_corpus("klingon")


def test_a_study_identifies_a_mix_by_every_file_it_reads():
    from slmedge.study.inputs import calibration_inputs

    inputs = calibration_inputs("c4+multilingual:de,fr")
    assert set(inputs) == {"calibration/c4_en.jsonl", "calibration/multilingual/de.txt", "calibration/multilingual/fr.txt"}
    assert inputs["calibration/c4_en.jsonl"] == calibration_inputs("c4")["calibration/c4_en.jsonl"]


def test_the_default_calibration_holds_c4_and_every_shipped_language(tok):
    # The default (measured in benchmarks/calibration.py): C4 in every other window, and each
    # shipped multilingual language in turn in the others; compress, imatrix and run all use it.
    from slmedge.compress.recipe import Recipe
    from slmedge.data import DEFAULT_CALIBRATION
    from slmedge.data.files import data_files

    assert Recipe().calibration == DEFAULT_CALIBRATION
    langs = data_files().names("calibration/multilingual", ".txt")
    groups, origin = read_sources(DEFAULT_CALIBRATION)
    streams = [[token_stream(tok, texts) for texts in group] for group in groups]
    assert [len(g) for g in streams] == [1, len(langs)] and len(origin["files"]) == 1 + len(langs)
    rows = load_calibration(DEFAULT_CALIBRATION, tok, 2 * len(langs), 16).tokens.tolist()
    assert all(_within(r, streams[0][0]) for r in rows[0::2])
    assert all(_within(r, ids) for r, ids in zip(rows[1::2], streams[1]))
