import torch
from rlhf_cli.demo.tiny_model import TinyModelSpec, build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_fixture_folder_loads_and_generates(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tok.bos_token and tok.eos_token and tok.pad_token
    assert len(tok) <= model.config.vocab_size
    text = tok.apply_chat_template(
        [{"role": "user", "content": "what is 2 + 3"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")
    assert tok.decode(ids["input_ids"][0]) == text  # byte-level BPE round-trips
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_same_spec_same_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", TinyModelSpec(seed=3))
    b = build_tiny_model(tmp_path / "b", TinyModelSpec(seed=3))
    ma, mb = AutoModelForCausalLM.from_pretrained(a), AutoModelForCausalLM.from_pretrained(b)
    for (n, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), n


def test_free_port_can_be_bound():
    import socket

    from rlhf_testkit import free_port

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
