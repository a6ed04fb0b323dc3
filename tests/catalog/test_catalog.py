"""Models by name from where they already are (issue #35): moed's folders, Ollama's store, the Hugging Face cache
and LM Studio's folder, laid out as those programs write them; files are read in place (same inode), never
copied, and hostile or broken entries are skipped with a log line, never followed out of the store."""

from __future__ import annotations

import json
import os

import pytest
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import write_tiny_gguf
from helpers.model_stores import add_hf_cache_repo, add_lmstudio_model, add_ollama_model
from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.catalog.catalog import Catalog, CatalogRoots
from moed.catalog.gguf_tags import pick_file, quant_tag
from moed.engine.model_manager import LoadOptions, ModelManager
from moed.engine.request import GenerationRequest
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError

OLLAMA_PARAMS = {"stop": ["<|im_end|>"], "temperature": 0.6, "num_ctx": 4096}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path_factory.mktemp("build"), expert_type=T.Q8_0,
                                 weight_type=T.Q8_0)
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory, gguf):
    root = tmp_path_factory.mktemp("stores")
    own = root / "moed"
    build_tiny_model("qwen3_moe", own / "mine")
    write_tiny_tokenizer(own / "mine")
    ollama = root / "ollama"
    blob = add_ollama_model(ollama, gguf, "tiny-qwen:latest", params=OLLAMA_PARAMS, template="{{ .Prompt }}",
                            system="You are terse.")
    add_ollama_model(ollama, gguf, "someone/tiny-qwen:q8")
    add_ollama_model(ollama, gguf, "hf.co/org/Tiny-GGUF:Q8_0", host="hf.co")
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "broken").mkdir(parents=True)
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest").write_text("{not json")
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "escape").mkdir(parents=True)
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "escape" / "latest").write_text(json.dumps({
        "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../../../etc/passwd"}]}))
    hf = root / "hf"
    add_hf_cache_repo(hf, "org/Tiny-Qwen3-GGUF", {"Tiny-Qwen3-Q8_0.gguf": gguf, "Tiny-Qwen3-Q4_K_M.gguf": gguf,
                                                 "README.md": gguf.with_name("model.gguf")})
    add_hf_cache_repo(hf, "org/tiny-qwen3", {"config.json": own / "mine" / "config.json",
                                            "model.safetensors": next((own / "mine").glob("*.safetensors")),
                                            "tokenizer.json": own / "mine" / "tokenizer.json"})
    lms = root / "lmstudio"
    add_lmstudio_model(lms, "lmstudio-community", "Tiny-GGUF", gguf, "Tiny-IQ4_XS.gguf")
    add_lmstudio_model(lms, "lmstudio-community", "Tiny-GGUF", gguf, "mmproj-Tiny-F16.gguf")
    return CatalogRoots(moed=(own,), ollama=(ollama,), huggingface=hf, lmstudio=(lms,)), blob


def test_every_source_is_listed_by_the_names_people_use(stores):
    roots, blob = stores
    listed = {e.name: e for e in Catalog(roots).list()}
    assert set(listed) == {"mine", "tiny-qwen:latest", "someone/tiny-qwen:q8", "hf.co/org/Tiny-GGUF:Q8_0",
                           "org/Tiny-Qwen3-GGUF:Q8_0", "org/Tiny-Qwen3-GGUF:Q4_K_M", "org/tiny-qwen3",
                           "lmstudio-community/Tiny-GGUF:IQ4_XS"}  # broken / escaping manifests and mmproj skipped
    ollama = listed["tiny-qwen:latest"]
    assert ollama.source == "ollama" and ollama.format == "gguf" and ollama.path == blob
    assert ollama.params == OLLAMA_PARAMS and ollama.system == "You are terse." and ollama.template == "{{ .Prompt }}"
    assert ollama.digest.startswith("sha256:") and ollama.size == blob.stat().st_size
    assert listed["org/tiny-qwen3"].format == "hf" and listed["org/tiny-qwen3"].source == "huggingface"
    assert listed["mine"].source == "moed" and listed["lmstudio-community/Tiny-GGUF:IQ4_XS"].source == "lmstudio"


@pytest.mark.parametrize("asked, expected", [
    ("tiny-qwen", "tiny-qwen:latest"), ("tiny-qwen:latest", "tiny-qwen:latest"),
    ("library/tiny-qwen", "tiny-qwen:latest"), ("registry.ollama.ai/library/tiny-qwen:latest", "tiny-qwen:latest"),
    ("Tiny-Qwen", "tiny-qwen:latest"), ("someone/tiny-qwen:q8", "someone/tiny-qwen:q8"),
    ("hf.co/org/Tiny-GGUF:Q8_0", "hf.co/org/Tiny-GGUF:Q8_0"),
    ("org/Tiny-Qwen3-GGUF:q8_0", "org/Tiny-Qwen3-GGUF:Q8_0"),
    ("org/Tiny-Qwen3-GGUF", "org/Tiny-Qwen3-GGUF:Q4_K_M"),  # no tag: llama.cpp's default Q4_K_M
    ("org/tiny-qwen3", "org/tiny-qwen3"), ("lmstudio-community/Tiny-GGUF:iq4_xs", "lmstudio-community/Tiny-GGUF:IQ4_XS"),
    ("mine", "mine"),
])
def test_names_resolve(stores, asked, expected):
    found = Catalog(stores[0]).resolve(asked)
    assert found is not None and found.name == expected, found


@pytest.mark.parametrize("asked", ["tiny-qwen:nope", "org/Tiny-Qwen3-GGUF:Q2_K", "escape", "broken", "../etc",
                                   "org/missing", "a" * 5000])
def test_unknown_names_resolve_to_nothing(stores, asked):
    assert Catalog(stores[0]).resolve(asked) is None


def test_an_ollama_model_loads_from_its_blob_in_place_and_answers(stores):
    roots, blob = stores
    inode = os.stat(blob).st_ino
    manager = ModelManager(list(roots.moed), catalog=Catalog(roots))
    entry = manager.load("tiny-qwen", LoadOptions(device="cpu", context_length=256))
    try:
        assert entry.name == "tiny-qwen:latest" and entry.source == "ollama"
        assert entry.path == blob and os.stat(entry.path).st_ino == inode  # the blob itself: nothing copied
        assert sorted(p.name for p in blob.parent.iterdir()) == sorted(os.listdir(blob.parent))  # no new files
        ids = entry.runtime.tokenizer.encode("The router reads")
        handle = entry.loop.submit(GenerationRequest("r1", ids, SamplingParams(max_tokens=4, ignore_eos=True)))
        assert len([t for e in handle.events() for t in e.token_ids]) == 4
    finally:
        manager.unload_all()


def test_a_name_found_nowhere_says_where_it_looked(stores):
    manager = ModelManager(list(stores[0].moed), catalog=Catalog(stores[0]))
    with pytest.raises(InvalidRequestError) as info:
        manager.load("qwen3:235b", LoadOptions(device="cpu"))
    message = str(info.value)
    assert "Ollama's store" in message and "Hugging Face cache" in message and "moed pull" in message


@pytest.mark.parametrize("file, tag", [
    ("Qwen3-30B-A3B-Q4_K_M.gguf", "Q4_K_M"), ("Qwen3-30B-A3B-UD-Q4_K_XL-00001-of-00002.gguf", "UD-Q4_K_XL"),
    ("gpt-oss-20b-MXFP4.gguf", "MXFP4"), ("model-bf16.gguf", "BF16"), ("DeepSeek-V3-IQ2_XXS.gguf", "IQ2_XXS"),
    ("tiny.gguf", ""), ("Qwen3-8B-q8_0.gguf", "Q8_0"),
])
def test_quant_tags_of_file_names(file, tag):
    assert quant_tag(file) == tag


def test_pick_file_prefers_the_exact_tag_and_the_first_split_part():
    names = ["a/M-Q4_K_M.gguf", "a/M-Q4_K_S.gguf", "a/M-Q8_0-00001-of-00002.gguf", "a/M-Q8_0-00002-of-00002.gguf"]
    assert pick_file(names, "q8_0") == "a/M-Q8_0-00001-of-00002.gguf"
    assert pick_file(names, None) == "a/M-Q4_K_M.gguf"
    assert pick_file(names, "Q2_K") is None
    assert pick_file(["only-F16.gguf"], None) == "only-F16.gguf"
