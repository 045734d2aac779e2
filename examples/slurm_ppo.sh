#!/usr/bin/env bash
# rlhf ppo on a SLURM allocation: Ray head on the first node, Ray workers on the others, then the run.
#
#   sbatch examples/slurm_ppo.sh
#
# What packages/cli/tests/test_two_hosts.py does on two test hosts, with SLURM's nodes:
# - every Ray node starts on its own address (--node-ip-address), the workers join the head's;
# - token authentication: one fresh token, the same on every node and for the driver;
# - run_dir on a file system every node sees: every rank writes its part of each checkpoint there;
# - --actor.num_nodes 2: the actor's ranks span both nodes (4 on each); weights reach the engines over
#   NCCL (on CPU-only clusters: gloo; shared memory when the cluster is one host).
# Adjust the #SBATCH lines, the model and the flags.
#SBATCH --job-name=rlhf-ppo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
set -euo pipefail

export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=$(openssl rand -hex 16)
export RAY_AUTH_TOKEN  # srun passes the environment on to every node's ray start

nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
ip_of() { srun --nodes=1 --ntasks=1 -w "$1" hostname --ip-address | awk '{print $1}'; }
head_ip=$(ip_of "${nodes[0]}")
port=6379

srun --nodes=1 --ntasks=1 -w "${nodes[0]}" \
    ray start --head --node-ip-address="$head_ip" --port=$port \
    --num-cpus="$SLURM_CPUS_PER_TASK" --num-gpus="$SLURM_GPUS_PER_NODE" --block &
sleep 20
for node in "${nodes[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "$node" \
        ray start --address="$head_ip:$port" --node-ip-address="$(ip_of "$node")" \
        --num-cpus="$SLURM_CPUS_PER_TASK" --num-gpus="$SLURM_GPUS_PER_NODE" --block &
done
sleep 20

rlhf ppo --ray.address "$head_ip:$port" \
    --actor.pretrain /shared/models/my-sft-model \
    --actor.num_nodes 2 --actor.num_devices_per_node 4 --actor.lr 1e-6 \
    --ref.num_devices_per_node 2 \
    --rollout.num_engines 2 --rollout.tensor_parallel_size 2 \
    --reward.func /shared/rewards/math_reward.py \
    --data.path /shared/data/prompts.jsonl --data.apply_chat_template \
    --algo.advantage.estimator group_norm --algo.kl.coef 0.001 --algo.kl.use_loss \
    --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --rollout.max_new_tokens 1024 \
    --rollout.max_model_len 2048 --train.micro_batch_size 4 --train.num_steps 500 \
    --learner.zero_stage 3 --learner.precision bf16 \
    --ckpt.save_steps 50 --logger.run_dir /shared/runs/ppo-math
