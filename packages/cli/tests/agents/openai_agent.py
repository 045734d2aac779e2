"""An agent written against the OpenAI API, for ``rlhf ppo --train.agent_func_path`` (see the tests).

Two turns: a chat call, then a completion that continues the exact token ids of the first (its prompt
plus its answer) after a "tool result", so both turns form one trajectory. A real agent would tokenize
its tool output with the policy's tokenizer; this one reuses the assistant header of the first prompt.
The reward is the number of characters the agent got back, scaled (any float works).
"""

from __future__ import annotations

import openai


async def run_agent(*, base_url: str, api_key: str, prompt: str, label) -> float:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=120.0, max_retries=0) as client:
        first = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=4,
            extra_body={"return_token_ids": True},
        )
        prompt_ids = first.model_extra["prompt_token_ids"]
        context = prompt_ids + first.choices[0].model_extra["token_ids"]
        tool_result = prompt_ids[-2:]  # e.g. "<|im_start|>assistant\n" style header tokens
        second = await client.completions.create(model="policy", prompt=context + tool_result, max_tokens=4)
    text = (first.choices[0].message.content or "") + second.choices[0].text
    return len(text) / 10.0
