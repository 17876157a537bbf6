"""A real `tokenizer.json` and a Jinja chat template drive token counts and block boundaries, and
the pseudo-text streams the same as it answers; SGLang and vLLM probe endpoints answer."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from ownerserve.hashing import block_hash_chain, chain_root
from ownerserve.tokenizer import ChatTemplate, HFTokenizer
from tests.workers.emulator.conftest import StartEmulator
from workers.emulator.textgen import WORDS

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def train_tokenizer(path: Path) -> Path:
    """A small byte-level BPE trained on local text (no model hub here)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(WORDS)] * 20 + ["the repository layout and the router cache"] * 20
    tok.train_from_iterator(corpus, trainer)
    file = path / "tokenizer.json"
    tok.save(str(file))
    return file


async def test_hf_tokenizer_and_jinja_template(
    start_emulator: StartEmulator, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    tok_file = train_tokenizer(tmp_path)
    tpl_file = tmp_path / "template.jinja"
    tpl_file.write_text(TEMPLATE)
    server = await start_emulator(tokenizer=str(tok_file), chat_template=str(tpl_file))
    messages = [{"role": "user", "content": "explain the repository layout and the router cache"}]
    body = {"messages": messages, "max_tokens": 20, "ignore_eos": True}
    resp = await http.post(server.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    hf = HFTokenizer(tok_file)
    ids = hf.encode(ChatTemplate(TEMPLATE).render(messages))
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == 20
    text = out["choices"][0]["message"]["content"]
    assert text and all(w in WORDS for w in text.split())
    chunks = []
    async with http.stream(
        "POST", server.url + "/v1/chat/completions", json={**body, "stream": True}
    ) as streamed:
        async for line in streamed.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(line)
    streamed_text = "".join(
        c["delta"].get("content", "") for line in chunks for c in orjson.loads(line[6:])["choices"]
    )
    assert streamed_text == text
    listing = (await http.get(server.url + "/kv_blocks")).json()
    expected = block_hash_chain(ids, 16, chain_root("ownerserve-tiny"))
    assert expected and set(expected) <= set(listing["block_hashes"])


async def test_probe_endpoints(start_emulator: StartEmulator, http: httpx.AsyncClient) -> None:
    server = await start_emulator(role="decode", num_blocks=100, worker_id="d9")
    url = server.url
    info = (await http.get(url + "/server_info")).json()
    assert info["disaggregation_mode"] == "decode"
    assert info["max_total_num_tokens"] == 1600 and info["page_size"] == 16
    assert "model_path" not in info and "tokenizer_path" not in info
    assert (await http.get(url + "/get_server_info")).json() == info
    model = (await http.get(url + "/model_info")).json()
    assert model["is_generation"] is True and "model_path" not in model
    load = (await http.get(url + "/get_load")).json()
    assert load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert (await http.get(url + "/health")).status_code == 200
    assert (await http.get(url + "/version")).json()["version"]
    detok = await http.post(url + "/detokenize", json={"tokens": [104, 105]})
    assert detok.json() == {"prompt": "hi"}
    tok = await http.post(url + "/tokenize", json={"prompt": "hi"})
    assert tok.json()["tokens"] == [104, 105]
