"""rlhf-rollout: token-in-token-out rollout.

Engines (vLLM on GPU or CPU, transformers) behind one protocol, Ray actor wrappers, agent executors
(single-turn with rewards, multi-turn environments, OpenAI-API agents) and reward clients. ``vllm``,
``ray`` and ``fastapi`` are imported only by the modules that need them.
"""

from rlhf_rollout._calls import UserCodeError, reworded
from rlhf_rollout.async_vllm_engine import AsyncEngineActor, AsyncVLLMEngine
from rlhf_rollout.cores import pin_to_cores
from rlhf_rollout.engine import (
    EngineCapabilities,
    RolloutEngine,
    TokenGenerator,
    UnsupportedOperationError,
    WeightSyncReport,
    WeightSyncRPC,
    check_prompts,
)
from rlhf_rollout.engine_faults import EngineFaults, EngineReplacer, engine_death
from rlhf_rollout.executors import (
    AgentEnv,
    AgentExecutorBase,
    MultiTurnExecutor,
    OpenAIAgentExecutor,
    SingleTurnExecutor,
    StepResult,
    Trajectory,
    chat_feedback_tokens,
    trajectories_from_records,
)
from rlhf_rollout.hf_engine import TransformersEngine, process_logits
from rlhf_rollout.images import ImagePrompt, prompt_images
from rlhf_rollout.openai_server import CallRecord, OpenAIServer
from rlhf_rollout.ray_engines import (
    EngineActor,
    EngineClient,
    Shard,
    create_engines,
    engines_started,
)
from rlhf_rollout.remote_reward import RemoteReward, RemoteRewardError
from rlhf_rollout.rewards import RewardFunction, RewardResult, RewardSource, load_reward_func
from rlhf_rollout.types import FinishReason, Generation, SamplingParams, VersionSpan, oldest_version
from rlhf_rollout.vllm_engine import VLLMEngine

__version__ = "0.1.0"

__all__ = [
    "AgentEnv",
    "AgentExecutorBase",
    "AsyncEngineActor",
    "AsyncVLLMEngine",
    "CallRecord",
    "EngineActor",
    "EngineCapabilities",
    "EngineClient",
    "EngineFaults",
    "EngineReplacer",
    "FinishReason",
    "Generation",
    "ImagePrompt",
    "MultiTurnExecutor",
    "OpenAIAgentExecutor",
    "OpenAIServer",
    "RemoteReward",
    "RemoteRewardError",
    "RewardFunction",
    "RewardResult",
    "RewardSource",
    "RolloutEngine",
    "SamplingParams",
    "Shard",
    "SingleTurnExecutor",
    "StepResult",
    "TokenGenerator",
    "Trajectory",
    "TransformersEngine",
    "UnsupportedOperationError",
    "UserCodeError",
    "VLLMEngine",
    "VersionSpan",
    "WeightSyncRPC",
    "WeightSyncReport",
    "chat_feedback_tokens",
    "check_prompts",
    "create_engines",
    "engine_death",
    "engines_started",
    "load_reward_func",
    "oldest_version",
    "pin_to_cores",
    "process_logits",
    "prompt_images",
    "reworded",
    "trajectories_from_records",
]
