"""The canaries test the serving path, so the prompt content is held fixed between the arms (issue #37
item 7, the false alarm it caused on the real vLLM server).

With canaries on by default for server arms, the vLLM test's candidate (the same model, a ~260-token
preamble added) answered its head canaries 2 of 2 and the baseline 0 of 2 at 768 tokens: built under
each arm's preamble, the two arms' head canaries sat at different distances from the start of the
prompt, and a position effect of the model read as ``canary_head_lost`` (FAIL_SYSTEM, exit 13) on a
correct server. Here, with the real GPT-2 tokenizer and the real Llama-2 chat template: two arms that
differ in preamble, assembler or system prompt build the very same canary ids; what belongs to the path
(the chat template) still changes them, and every canary stays token-exact.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from tokenizers import Tokenizer as HFTokenizer

from depthgate.layout.layouts import BuildOptions, load_tokenizer, parse_positions
from depthgate.layout.templates import ChatTemplate
from depthgate.run.canary import build_canaries
from fixtures_paths import tokenizers_dir

GPT2 = tokenizers_dir() / "gpt2" / "tokenizer.json"
POSITIONS = parse_positions(["0.5"])
LLAMA2 = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
    "message['content'] + ' [/INST]' }}{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' + "
    "message['content'] + '\\n<</SYS>>\\n\\n' }}{% endif %}{% endfor %}"
)


def _canaries(tmp: Path, name: str, **options: object) -> pl.DataFrame:
    out = tmp / name / "canaries.parquet"
    build_canaries(load_tokenizer(GPT2), BuildOptions(lengths=[640], positions=POSITIONS, **options), 2, out)  # type: ignore[arg-type]
    return pl.read_parquet(out).sort("layout_id")


def test_arms_differing_only_in_prompt_content_send_the_same_canaries(tmp_path: Path) -> None:
    plain = _canaries(tmp_path, "plain")
    content = _canaries(
        tmp_path,
        "content",
        preamble="About this document. Read the excerpt carefully and answer the question that follows.",
        assembler="query-first",
    )
    assert plain.height == content.height == 4  # 2 head + 2 tail at the one length
    assert plain["token_ids"].to_list() == content["token_ids"].to_list()
    assert plain["layout_id"].to_list() == content["layout_id"].to_list()
    # The chat template is part of the serving path: it still shapes the canary.
    chat = _canaries(
        tmp_path, "chat", template=ChatTemplate(source=LLAMA2, path="llama2.jinja", bos_token="<s>")
    )
    assert chat["token_ids"].to_list() != plain["token_ids"].to_list()
    # Token-exact: the ids are the encoding of the rendered text, and each is the tested length.
    hf = HFTokenizer.from_file(str(GPT2))
    for frame in (plain, chat):
        for row in frame.iter_rows(named=True):
            assert hf.encode(row["text"], add_special_tokens=False).ids == row["token_ids"]
            assert len(row["token_ids"]) == 640
