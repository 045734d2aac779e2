"""Prompts with images (``ImagePrompt``): the ids an engine that expands images itself is given, which tokens
are the images' as turns are appended, pickling to actors, and reward functions that take the images."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from PIL import Image
from rlhf_rollout import ImagePrompt, RewardFunction, prompt_images

PAD = 9


def _prompt() -> ImagePrompt:
    # two images: 3 and 2 tokens, each between a start (7) and an end (8) token
    return ImagePrompt(
        [1, 7, PAD, PAD, PAD, 8, 2, 7, PAD, PAD, 8, 3],
        images=[Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))],
        image_token_id=PAD,
        image_token_counts=[3, 2],
    )


def test_an_engine_gets_one_placeholder_per_image_and_a_sampled_placeholder_stays_text():
    p = _prompt()
    assert p.engine_ids() == [1, 7, PAD, 8, 2, 7, PAD, 8, 3]
    turn = p.extended([4, PAD, 5])  # the policy sampled a placeholder token: text, not an image
    assert turn.image_mask()[-3:] == [False, False, False] and sum(turn.image_mask()) == 5
    assert turn.engine_ids() == [1, 7, PAD, 8, 2, 7, PAD, 8, 3, 4, PAD, 5]
    shown = ImagePrompt([6, PAD, PAD], images=["third"], image_token_id=PAD, image_token_counts=[2])
    both = turn.joined(shown)  # an environment's answer with an image of its own
    assert both.images[-1] == "third" and both.image_token_counts == (3, 2, 2)
    assert both.engine_ids() == [1, 7, PAD, 8, 2, 7, PAD, 8, 3, 4, PAD, 5, 6, PAD]
    assert prompt_images(both) == both.images and prompt_images([1, 2]) == ()


def test_it_pickles_with_its_images_and_refuses_counts_that_do_not_add_up():
    p = pickle.loads(pickle.dumps(_prompt()))
    assert list(p) == list(_prompt()) and p.image_token_counts == (3, 2)
    assert p.images[1].getpixel((0, 0)) == (0, 0, 255) and p.engine_ids() == _prompt().engine_ids()
    with pytest.raises(ValueError, match="5 image tokens in the ids, the images take 4"):
        ImagePrompt(list(p), images=p.images, image_token_id=PAD, image_token_counts=[2, 2])
    with pytest.raises(ValueError, match="2 images but 1 token counts"):
        ImagePrompt(list(p), images=p.images, image_token_id=PAD, image_token_counts=[5])


def test_a_reward_function_gets_the_images_when_it_takes_them():
    seen = {}

    def with_images(queries, prompts, labels, images=None):
        seen["images"] = images
        return [float(len(i)) for i in images]

    def with_kwargs(queries, prompts, labels, **kwargs):
        seen["kwargs"] = kwargs
        return [0.0] * len(queries)

    def text_only(queries, prompts, labels):
        return [1.0] * len(queries)

    call = dict(queries=["a", "b"], prompts=["", ""], labels=[None, None], images=[("x",), ("y", "z")])
    assert asyncio.run(RewardFunction(with_images).ascore(**call)).rewards == [1.0, 2.0]
    assert seen["images"] == [["x"], ["y", "z"]]
    asyncio.run(RewardFunction(with_kwargs).ascore(**call))
    assert seen["kwargs"] == {"images": [["x"], ["y", "z"]]}
    assert asyncio.run(RewardFunction(text_only).ascore(**call)).rewards == [1.0, 1.0]
