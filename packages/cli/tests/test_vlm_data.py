"""Image data for vision-language models, without Ray: rows read in every form, prompt ids built once as the
processor builds them, bad rows refused in one line, image rows batched so each keeps its own M-RoPE
positions, and the transformers engine (one turn, and several with an environment that shows an image)
sampling the log-probs the learner computes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def encoder(vlm_dir):
    from rlhf_cli.data.images import ImageEncoder

    return ImageEncoder.for_model(vlm_dir)


@pytest.fixture(scope="module")
def actor(vlm_dir):
    from rlhf_learner.models import Actor, load_causal_lm

    return Actor(load_causal_lm(vlm_dir)).eval()


def _png(colour, size=56) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return out.getvalue()


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_ids_are_the_processors_own_for_messages_and_for_text(encoder):
    red, blue = Image.new("RGB", (84, 84), (220, 0, 0)), Image.new("RGB", (56, 112), (0, 0, 220))
    messages = [
        {"role": "system", "content": "look closely"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
    ]
    proc = encoder.processor
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    want = proc(text=[text], images=[red, blue], return_tensors="pt")
    got = encoder.prompt(messages, [red, blue])
    assert list(got) == want["input_ids"][0].tolist()
    assert got.image_token_counts == (9, 8)  # 84x84: 6x6 patches merged 2x2; 56x112: 4x8
    plain = encoder.prompt("<image>and<image>", [red, blue])  # text: one user message of parts
    user = [{"role": "user", "content": messages[1]["content"]}]
    want = proc(text=[proc.apply_chat_template(user, add_generation_prompt=True)], images=[red, blue])
    assert list(plain) == want["input_ids"][0]


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_sft_and_dpo_examples_hold_the_processors_ids_and_make_its_pixels_per_batch(tmp_path, model_type):
    """An image row of rlhf sft / dpo: its ids are the processor's for the whole conversation (each image's
    token count known from its size, no pixels made at load), its loss on the response alone; the pixels
    are made when a batch holds it, equal to the processor's."""
    from rlhf_cli.config.offline import PairData, SFTData
    from rlhf_cli.data.batches import dpo_batch, sft_batch_from_examples
    from rlhf_cli.data.examples import load_pairs, load_sft
    from rlhf_cli.data.images import ExampleImages, ImageEncoder
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm

    encoder = ImageEncoder.for_model(build_tiny_vlm(tmp_path / "model", model_type=model_type))
    proc = encoder.processor
    for k, size in enumerate([(84, 84), (56, 140)]):
        Image.new("RGB", size, (200, 30 * k, 10)).save(tmp_path / f"{k}.png")
    row = {"prompt": "<image>and<image>: colours?", "response": " red, orange", "images": ["0.png", "1.png"]}
    (ex,) = load_sft(_write(tmp_path / "sft.jsonl", [row]), proc.tokenizer, SFTData(), encoder=encoder)
    assert isinstance(ex.images, ExampleImages) and not any(
        isinstance(v, torch.Tensor) and v.is_floating_point() for v in vars(ex.images).values()
    )  # the pixels are not kept
    images = [Image.open(tmp_path / f"{k}.png").convert("RGB") for k in range(2)]
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    user = [{"role": "user", "content": [*parts, {"type": "text", "text": ": colours?"}]}]
    whole = [*user, {"role": "assistant", "content": " red, orange"}]
    want = proc(text=[proc.apply_chat_template(whole, tokenize=False)], images=images, return_tensors="pt")
    prompt = proc(text=[proc.apply_chat_template(user, add_generation_prompt=True)], images=images)
    n = len(prompt["input_ids"][0])
    got = ex.token_ids.tolist()
    assert got[: len(want["input_ids"][0])] == want["input_ids"][0].tolist()
    assert ex.loss_mask[:n].sum() == 0 and ex.loss_mask[n:].all()
    batch = sft_batch_from_examples([ex], packing=True)
    torch.testing.assert_close(batch.pixel_values, want["pixel_values"])
    assert torch.equal(batch.image_grid_thw, want["image_grid_thw"])
    pair = {"prompt": row["prompt"], "chosen": " red", "rejected": " blue", "images": row["images"]}
    (p,) = load_pairs(_write(tmp_path / "dpo.jsonl", [pair]), proc.tokenizer, PairData(), encoder=encoder)
    for response in (p.chosen, p.rejected):
        assert response.token_ids[:n].tolist() == list(prompt["input_ids"][0])
        assert response.loss_mask[:n].sum() == 0 and response.loss_mask[n:].all()
    made, pixels = [], encoder.pixels
    encoder.pixels = lambda images: made.append(len(images)) or pixels(images)
    rows = dpo_batch([p], ref_logp=torch.zeros(2))
    assert made == [2]  # once for the pair: its responses share the row's images
    torch.testing.assert_close(rows.pixel_values, torch.cat([want["pixel_values"]] * 2))


def test_images_are_read_from_paths_data_uris_and_datasets_folders(tmp_path, vlm_dir):
    import datasets
    from rlhf_cli.data.prompts import load_records

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "r.png").write_bytes(_png((200, 10, 10)))
    uri = "data:image/png;base64," + base64.b64encode(_png((10, 10, 200))).decode()
    rows = [
        {"input": "<image>colour?", "label": "red", "images": "img/r.png"},
        {
            "input": [{"role": "user", "content": "<image><image>same?"}],
            "label": "no",
            "images": ["img/r.png", uri],
        },
        {"input": "no picture", "label": "x"},
    ]
    data = _write(tmp_path / "p.jsonl", rows)
    keys = dict(input_key="input", label_key="label", image_key="images", model_takes_images=True)
    recs = load_records(data, **keys)
    assert [len(r.images) for r in recs] == [1, 2, 0]
    assert recs[1].images[1].getpixel((3, 3)) == (10, 10, 200) and recs[0].images[0].mode == "RGB"
    folder = tmp_path / "ds"
    images = [[Image.open(io.BytesIO(_png((200, 10, 10))))], [Image.open(io.BytesIO(_png((10, 200, 10))))]]
    features = datasets.Features(
        {"input": datasets.Value("string"), "label": datasets.Value("string"), "images": [datasets.Image()]}
    )
    table = {"input": ["<image>colour?"] * 2, "label": ["red", "green"], "images": images}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(folder)
    recs = load_records(folder, **keys)
    assert [r.images[0].getpixel((0, 0)) for r in recs] == [(200, 10, 10), (10, 200, 10)]


@pytest.mark.parametrize(
    ("row", "error"),
    [
        ({"images": "gone.png"}, "image 0 of 'images': '{dir}/gone.png' does not exist"),
        ({"images": "bad.png"}, "image 0 of 'images': 'bad.png' does not decode as an image"),
        ({"images": ["ok.png", "ok.png"]}, "2 image(s) under 'images' but 1 placeholder(s) in the prompt"),
        ({"images": [], "input": "<image><image>?"}, None),  # an empty list: a text row
        ({"images": "ok.png", "input": "no place"}, "1 image(s) under 'images' but 0 placeholder(s)"),
    ],
)
def test_a_bad_image_row_is_refused_in_one_line_naming_the_file_and_line(tmp_path, row, error):
    from rlhf_cli.data.prompts import load_records

    (tmp_path / "bad.png").write_text("not an image")
    (tmp_path / "ok.png").write_bytes(_png((1, 2, 3)))
    data = _write(tmp_path / "p.jsonl", [{"input": "<image>?", "label": 1}, {"input": "<image>?", **row}])
    keys = dict(input_key="input", label_key=None, image_key="images", model_takes_images=True)
    if error is None:
        assert [len(r.images) for r in load_records(data, **keys)] == [0, 0]
        return
    with pytest.raises(ValueError) as caught:
        load_records(data, **keys)
    message = str(caught.value)
    assert message.startswith(f"{data}, line 2: ") and "\n" not in message
    assert error.format(dir=tmp_path) in message


def test_images_for_a_text_only_model_are_refused_naming_the_row(tmp_path, demo_model_dir):
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.prompts import load_prompts
    from transformers import AutoTokenizer

    (tmp_path / "ok.png").write_bytes(_png((1, 2, 3)))
    rows = [{"input": "hi", "label": 1}, {"input": "<image>?", "label": 1, "images": "ok.png"}]
    data = _write(tmp_path / "p.jsonl", rows)
    cfg = build_config(
        PPOConfig,
        ["--actor.pretrain", str(demo_model_dir), "--data.path", str(data), "--reward.func", "r.py"],
    )
    with pytest.raises(ValueError) as caught:
        load_prompts(cfg, AutoTokenizer.from_pretrained(demo_model_dir), demo_model_dir)
    assert str(caught.value) == (
        f"{data}, line 2: has images under 'images' (--data.image_key), but the model is text-only"
    )


def test_an_unsupported_vision_language_model_is_refused_in_one_line(tmp_path, vlm_dir):
    """A model with a vision tower outside the Qwen2-VL family (its config's model_type) is refused before
    anything loads, naming the folder and the supported types."""
    import shutil

    from rlhf_learner.models import load_causal_lm

    other = shutil.copytree(vlm_dir, tmp_path / "llava")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"model_type": "llava"}))
    with pytest.raises(ValueError) as caught:
        load_causal_lm(other)
    assert str(caught.value) == (
        f"model folder '{other}': vision-language model_type 'llava' is not supported; supported: "
        "qwen2_vl, qwen2_5_vl, qwen3_vl"
    )


def test_rows_with_and_without_images_on_sharded_ranks_are_refused_before_start(tmp_path, vlm_dir):
    """fsdp2 over two data-parallel ranks: a rank whose micro-batch had no image would skip the vision
    tower's gathers the other waits in; on one rank the same data is taken."""
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.prompts import load_prompts
    from transformers import AutoTokenizer

    (tmp_path / "ok.png").write_bytes(_png((1, 2, 3)))
    rows = [{"input": "hi", "label": 1}, {"input": "<image>?", "label": 1, "images": "ok.png"}]
    data = _write(tmp_path / "p.jsonl", rows)
    base = ["--actor.pretrain", str(vlm_dir), "--data.path", str(data), "--reward.func", "r.py"]
    tok = AutoTokenizer.from_pretrained(vlm_dir)
    cfg = build_config(PPOConfig, base)
    train, _ = load_prompts(cfg, tok, vlm_dir)
    assert [len(p.images) if hasattr(p, "images") else 0 for p in train.token_ids] == [0, 1]
    sharded = [
        "--learner.backend",
        "fsdp2",
        "--actor.num_devices_per_node",
        "2",
        "--train.micro_batch_size",
        "1",
    ]
    with pytest.raises(ValueError) as caught:
        load_prompts(build_config(PPOConfig, [*base, *sharded]), tok, vlm_dir)
    assert str(caught.value).startswith(
        f"{data}: 1 of 2 rows have images; with parameters gathered in each forward over 2"
    )


def _sequences(encoder, side: int = 56):
    """Three sequences of different lengths and image sizes (``side`` pixels high, 1, 1.5 and 2 times as
    wide); the last response holds a placeholder token."""
    from rlhf_cli.demo import shapes

    out = []
    for k, r in enumerate(shapes.records(seed=5, count=3)):
        images = [r.images[0].resize((side + side // 2 * k, side))]
        prompt = encoder.prompt(r.prompt, images)
        response = [40 + k] * (3 + 2 * k) + ([encoder.image_token_id, 41] if k == 2 else [])
        ids = torch.tensor([*prompt, *response])
        sampled = torch.tensor([False] * len(prompt) + [True] * len(response))
        out.append((ids, sampled, encoder.inputs(images, ids, sampled)))
    return out


def _assert_sampled_placeholder_read_as_text(model_dir, actor, ids, images, image_token_id):
    """The actor's log-probs of ``ids`` (a placeholder token among its sampled ones) equal those of a model
    that never sees that token as a placeholder: the token given as id 0 to a copy whose embedding row 0 is
    the placeholder's (its output head untied first), at every position but the placeholder's own."""
    from rlhf_cli.data.batches import to_rows
    from rlhf_learner.models import Actor, load_causal_lm

    reference = load_causal_lm(model_dir).eval()
    embedding = reference.get_input_embeddings().weight
    with torch.no_grad():
        reference.lm_head.weight = torch.nn.Parameter(embedding.detach().clone())
        embedding[0] = embedding[image_token_id]
    sampled = (ids == image_token_id) & ~torch.isin(torch.arange(len(ids)), images.positions)
    assert sampled.sum() == 1
    one = dict(to_rows([{"input_ids": ids}], packing=False, images=[images]).tensors)
    with torch.no_grad():
        got = actor(one.pop("input_ids"), **one).logp[0]
        one = dict(
            to_rows([{"input_ids": ids.masked_fill(sampled, 0)}], packing=False, images=[images]).tensors
        )
        want = Actor(reference)(one.pop("input_ids"), **one).logp[0]
    torch.testing.assert_close(got[~sampled], want[~sampled], atol=1e-5, rtol=0)


def test_a_sync_leaves_the_frozen_tower_out_unless_the_engines_drop_their_weights(vlm_dir):
    """The frozen vision tower is not sent (the engines hold it from the checkpoint), except to colocated
    engines that sleep at level 2: vLLM discards their weights, so every sync sends the tower again."""
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_learner.models import load_causal_lm, trained_parameters

    model = load_causal_lm(vlm_dir)  # the tower frozen, as by default
    names = {n for n, _ in model.named_parameters()}
    tower = {n for n in names if ".visual." in f".{n}" and "merger" not in n}
    assert tower and {n for n, _ in trained_parameters(model)} == names - tower
    assert {n for n, _ in trained_parameters(model, with_frozen_tower=True)} == names
    colocated = ("--train.colocate_all", "true")
    assert build_config(PPOConfig, [*colocated, "--vllm.sleep_level", "2"]).engines_drop_weights
    assert not build_config(PPOConfig, [*colocated, "--vllm.sleep_level", "1"]).engines_drop_weights
    assert not build_config(PPOConfig, ["--vllm.sleep_level", "2"]).engines_drop_weights


def test_packed_and_padded_image_rows_give_each_sequence_its_own_log_probs(encoder, actor, vlm_dir):
    """Image rows packed (several sequences in a row, the learner computing each one's M-RoPE positions) and
    padded (one sequence each) give each sequence the log-probs it has alone; a sampled placeholder token is
    text. Text rows on the same model are packed too, each sequence attending to itself only."""
    from rlhf_cli.data.batches import to_rows

    seqs = _sequences(encoder)
    _assert_sampled_placeholder_read_as_text(vlm_dir, actor, seqs[2][0], seqs[2][2], encoder.image_token_id)
    text = torch.tensor([3] + [40 + k % 20 for k in range(81)])  # the longest: image rows fit in one
    seqs = [*seqs, (text, None, None)]
    assert seqs[2][2].positions.numel() == 8  # 112x56 pixels: 8 tokens; the sampled one is not counted
    images = [i for _, _, i in seqs]
    packed = to_rows([{"input_ids": ids} for ids, _, _ in seqs], packing=True, images=images)
    padded = to_rows([{"input_ids": ids} for ids, _, _ in seqs], packing=False, images=images)
    assert packed.tensors["input_ids"].shape[0] == 2 and "attention_mask" not in packed.tensors
    assert padded.tensors["input_ids"].shape[0] == len(seqs) and "position_ids" not in padded.tensors
    with torch.no_grad():
        for rows in (packed, padded):
            t = rows.tensors
            together = rows.split(
                actor(t["input_ids"], **{k: v for k, v in t.items() if k != "input_ids"}).logp
            )
            for (ids, _, image), lp in zip(seqs, together, strict=True):
                one = to_rows([{"input_ids": ids}], packing=False, images=[image] if image else ()).tensors
                alone = actor(one["input_ids"], **{k: v for k, v in one.items() if k != "input_ids"}).logp[0]
                torch.testing.assert_close(lp, alone, atol=1e-5, rtol=0)
    texts = [torch.tensor([3, 40, 41, 42, 43]), torch.tensor([3, 50, 51])]  # text rows on the same model
    packed = to_rows([{"input_ids": ids} for ids in texts], packing=True)
    assert "position_ids" in packed.tensors and packed.tensors["input_ids"].shape[0] == 1
    with torch.no_grad():
        together = packed.split(
            actor(packed.tensors["input_ids"], position_ids=packed.tensors["position_ids"]).logp
        )
        for ids, lp in zip(texts, together, strict=True):  # packed, each sequence sees only itself
            torch.testing.assert_close(
                lp, actor(ids[None], attention_mask=torch.ones_like(ids)[None]).logp[0]
            )


def test_a_critic_on_the_vision_language_model_values_packed_and_padded_image_rows_alike(encoder, vlm_dir):
    """The critic on a Qwen2-VL (its trunk under a fresh value head) reads the images: packed and padded
    rows give each sequence the values it has alone, and those differ when the image does."""
    from rlhf_cli.data.batches import to_rows
    from rlhf_learner.models import load_critic

    critic = load_critic(vlm_dir).eval()
    seqs = _sequences(encoder)
    images = [i for _, _, i in seqs]
    packed = to_rows([{"input_ids": ids} for ids, _, _ in seqs], packing=True, images=images)
    padded = to_rows([{"input_ids": ids} for ids, _, _ in seqs], packing=False, images=images)
    with torch.no_grad():
        alone = []
        for ids, _, image in seqs:
            one = to_rows([{"input_ids": ids}], packing=False, images=[image]).tensors
            alone.append(critic(one.pop("input_ids"), **one)[0])
        for rows in (packed, padded):
            t = dict(rows.tensors)
            for v, a in zip(rows.split(critic(t.pop("input_ids"), **t)), alone, strict=True):
                torch.testing.assert_close(v, a, atol=1e-5, rtol=0)
        ids, _, image = seqs[0]
        one = to_rows([{"input_ids": ids}], packing=False, images=[image]).tensors
        one["pixel_values"] = one["pixel_values"].flip(0)  # the same tokens, another picture
        assert not torch.allclose(critic(one.pop("input_ids"), **one)[0], alone[0], atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen2_5_and_qwen3_vl_rows_packed_and_padded_give_each_sequence_its_own_log_probs_and_values(
    tmp_path, model_type
):
    """Qwen2.5-VL (windowed vision attention) and Qwen3-VL (16-pixel patches, deepstack features): the
    actor's log-probs and the critic's values of image rows, packed and padded, are each sequence's alone;
    a sampled placeholder token is text."""
    from rlhf_cli.data.batches import to_rows
    from rlhf_cli.data.images import ImageEncoder
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm
    from rlhf_learner.models import Actor, load_causal_lm, load_critic

    model_dir = build_tiny_vlm(tmp_path / model_type, model_type=model_type)
    encoder = ImageEncoder.for_model(model_dir)
    seqs = [(ids, images) for ids, _, images in _sequences(encoder, side=64)]  # 16-pixel patches fit 64
    seqs.append((torch.tensor([3] + [40 + k % 20 for k in range(119)]), None))  # image rows share a row
    actor, critic = Actor(load_causal_lm(model_dir)).eval(), load_critic(model_dir).eval()
    _assert_sampled_placeholder_read_as_text(model_dir, actor, *seqs[2], encoder.image_token_id)
    score = {"actor": lambda ids, **kw: actor(ids, **kw).logp, "critic": critic}
    with torch.no_grad():
        for name, fn in score.items():
            alone = []
            for ids, images in seqs:
                one = dict(
                    to_rows([{"input_ids": ids}], packing=False, images=[images] if images else ()).tensors
                )
                alone.append(fn(one.pop("input_ids"), **one)[0])
            for packing in (True, False):
                rows = to_rows(
                    [{"input_ids": i} for i, _ in seqs], packing=packing, images=[m for _, m in seqs]
                )
                t = dict(rows.tensors)
                assert t["input_ids"].shape[0] == (2 if packing else 4)
                for got, want in zip(rows.split(fn(t.pop("input_ids"), **t)), alone, strict=True):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{name}, packing {packing}")


def test_the_transformers_engine_samples_the_learners_log_probs_over_turns_that_show_images(
    vlm_dir, encoder, actor
):
    """One turn, then an environment that answers with a new image: every sampled token's log-prob from
    the transformers engine equals the learner's from the whole trajectory and its two images."""
    from rlhf_cli.data.batches import to_rows
    from rlhf_cli.demo import shapes
    from rlhf_rollout import MultiTurnExecutor, SamplingParams, StepResult, TransformersEngine

    class ShowAnother:
        async def reset(self, *, prompt, label):
            self.turn = 0

        async def step(self, *, action):
            self.turn += 1
            if self.turn == 2:
                return StepResult(feedback="", reward=1.0, done=True)
            picture = Image.new("RGB", (84, 56), (0, 180, 0))
            return StepResult(feedback="<image>and this?", reward=0.0, done=False, images=(picture,))

    engine = TransformersEngine(model=str(vlm_dir))
    records = shapes.records(seed=2, count=2)
    prompts = [encoder.prompt(r.prompt, r.images) for r in records]
    executor = MultiTurnExecutor(
        engine=engine,
        params=SamplingParams(max_new_tokens=5, seed=3, n=2),
        tokenizer=encoder.processor.tokenizer,
        env_factory=ShowAnother,
        max_turns=2,
        max_length=256,
        render_images=encoder.feedback,
    )
    trajs = executor.run(prompts, labels=[None, None])
    assert [len(t.images) for t in trajs] == [2, 2, 2, 2]
    for t in trajs:
        ids, sampled = torch.tensor(t.token_ids), torch.tensor(t.action_mask)
        rows = to_rows([{"input_ids": ids}], packing=False, images=[encoder.inputs(t.images, ids, sampled)])
        x = rows.tensors
        with torch.no_grad():
            lp = actor(x["input_ids"], **{k: v for k, v in x.items() if k != "input_ids"}).logp[0]
        torch.testing.assert_close(lp[sampled], torch.tensor(t.logprobs)[sampled], atol=1e-4, rtol=0)


def test_an_openai_api_agent_on_image_prompts_is_refused_before_start(tmp_path, vlm_dir):
    """An OpenAI-API agent's calls carry text only: with prompts that show images, the run (and its
    ``--dry-run``) is refused while the inputs are read, before anything starts, naming the agent file."""
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.recipe import plan

    (tmp_path / "ok.png").write_bytes(_png((1, 2, 3)))
    data = _write(tmp_path / "p.jsonl", [{"input": "<image>?", "label": 1, "images": "ok.png"}])
    agent = tmp_path / "agent.py"
    agent.write_text("async def run_agent(*, base_url, api_key, prompt, label):\n    return 1.0\n")
    text = _write(tmp_path / "t.jsonl", [{"input": "hi", "label": 1}])
    flags = ["--actor.pretrain", str(vlm_dir), "--train.agent_func_path", str(agent)]
    for given in (["--data.path", str(data)], ["--data.path", str(text), "--eval.path", str(data)]):
        with pytest.raises(ValueError) as caught:
            plan(build_config(PPOConfig, [*flags, *given]))
        assert str(caught.value) == (
            f"--train.agent_func_path: {str(agent)!r} defines run_agent (an OpenAI-API agent, whose calls "
            "carry text only), but the prompts show images; define make_env() or reward_func instead"
        ), given
    assert plan(build_config(PPOConfig, [*flags, "--data.path", str(text)])).notes  # on text: accepted
