"""pipeline("text-generation"), streamers and stop strings with invisible_lora=True."""

import pytest
import torch
from transformers import TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

import hf_invisiblelora  # noqa: F401  (makes generate() accept invisible_lora=True)
from hf_invisiblelora.model.state import state_of
from tiny import prompts, tiny_peft, tiny_tokenizer

PROMPTS = ["the quick brown", "once upon a time", "hello"]
NAMES = ["s", "b", "__base__"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    assert len(tok) <= 64
    return tiny_peft("llama", vocab=64, strength=0.6)


def test_pipeline_greedy_matches_standard(model, tok):
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    kw = dict(adapter_names=NAMES, batch_size=len(PROMPTS), max_new_tokens=8, do_sample=False)
    ref = pipe(PROMPTS, **kw)
    out = pipe(PROMPTS, invisible_lora=True, num_draft_tokens=3, **kw)
    assert out == ref
    assert state_of(model).stats.adapter_names == NAMES


def test_pipeline_default_sampling(model, tok):
    """The pipeline samples by default (temperature 0.7, ...): that path must work too."""
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    out = pipe(PROMPTS, invisible_lora=True, adapter_names=NAMES, batch_size=len(PROMPTS), max_new_tokens=6)
    assert [o[0]["generated_text"].startswith(p) for o, p in zip(out, PROMPTS)] == [True] * 3
    assert state_of(model).stats.cycles > 0


def test_pipeline_with_one_prompt_per_call_explains_the_fix(model, tok):
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    with pytest.raises(ValueError, match="batch_size=len"):
        pipe(PROMPTS, invisible_lora=True, adapter_names=NAMES, max_new_tokens=4)


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_committed_tokens(model):
    ids, mask = prompts([6])
    rec = Recorder()
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=["b"], max_new_tokens=10, do_sample=False,
                         invisible_lora=True, num_draft_tokens=4, gate="always", streamer=rec)
    assert rec.chunks[0] == ids[0].tolist() and rec.ended
    assert sum(rec.chunks[1:], []) == out[0, ids.shape[1]:].tolist()
    # Tokens arrive as cycles commit them: several at once when drafts were accepted.
    assert len(rec.chunks) - 1 == state_of(model).stats.cycles + 1


def test_text_streamer_prints(model, tok, capsys):
    enc = tok(["once upon"], return_tensors="pt")
    out = model.generate(**enc, adapter_names=["s"], max_new_tokens=6, do_sample=False, invisible_lora=True,
                         streamer=TextStreamer(tok))
    assert capsys.readouterr().out.strip() == tok.decode(out[0], skip_special_tokens=True).strip()


def test_stop_strings_match_standard(model, tok):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    free = model.generate(**enc, adapter_names=NAMES, max_new_tokens=10, do_sample=False)
    # Stop on a piece of text that one row really produces mid-way.
    text = tok.decode(free[0, enc.input_ids.shape[1] + 2 : enc.input_ids.shape[1] + 4])
    assert text
    kw = dict(adapter_names=NAMES, max_new_tokens=10, do_sample=False, stop_strings=[text], tokenizer=tok)
    ref = model.generate(**enc, **kw)
    out = model.generate(**enc, invisible_lora=True, num_draft_tokens=4, **kw)
    assert torch.equal(out, ref)
    assert ref.shape[1] < free.shape[1] or (ref[0] == tok.pad_token_id).any()
