"""An RL loop with cbserve as its rollout engine, on Ray: generate rollouts over the OpenAI API, train on them in a
trainer actor (REINFORCE with a mean baseline on a toy reward: how often a target token appears), push the new
weights into every engine replica (cbserve.rl.RolloutEngines: the Ray object store, or a gloo weight group), and
generate again. The rollouts carry the version of the weights that made them (``weights_version``).

    cbserve serve --model MODEL_FOLDER --app-name rl &         # an HF folder the trainer can load too
    python examples/rl_loop.py --model MODEL_FOLDER --app rl --url http://127.0.0.1:8000 --steps 5

``tests/e2e/test_rl_loop.py`` runs it on a tiny model and checks, after every push, that cbserve's greedy tokens
equal HF transformers' with the trainer's weights.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import ray
import torch


@ray.remote(num_cpus=0)
class Trainer:
    """The policy in HF transformers, its optimizer, and the push of its weights to the app's engines."""

    def __init__(self, model: str, app_name: str, target_token: int, lr: float = 0.05,
                 transport: str = "object_store") -> None:
        from transformers import AutoModelForCausalLM

        from cbserve.rl.engines import RolloutEngines

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.target = target_token
        self.engines = RolloutEngines(app_name)
        self.transport = transport
        if transport == "group":
            self.engines.init_weight_transfer("gloo")

    def train_step(self, rollouts: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One optimizer step on (prompt ids, completion ids) rollouts: reward = the target token's frequency."""
        rewards = [c.count(self.target) / max(1, len(c)) for _, c in rollouts]
        baseline = statistics.fmean(rewards)
        self.model.train()
        loss = torch.zeros(())
        for (prompt, completion), reward in zip(rollouts, rewards, strict=True):
            if not completion:
                continue
            ids = torch.tensor([prompt + completion])
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1]
            logprobs = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None])
            loss = loss - (reward - baseline + 0.1) * logprobs.sum()  # + 0.1: the weights move every step
        loss = loss / len(rollouts)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.model.eval()
        return {"mean_reward": baseline, "loss": float(loss)}

    def push_weights(self, version: int) -> dict[str, Any]:
        """The whole state dict (HF names) to every rank of every replica; what replica 0 reports."""
        state = self.model.state_dict()
        if self.transport == "group":
            return self.engines.update_weights_from_group(state, version)[0]
        return self.engines.update_weights(state, version)[0]

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """HF transformers' greedy continuation with the current weights (no end-of-sequence stop)."""
        ids = list(prompt)
        for _ in range(max_tokens):
            ids.append(int(self.model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]


def rollouts(client: Any, model_name: str, prompts: list[list[int]], n: int, max_tokens: int,
             seed: int) -> tuple[list[tuple[list[int], list[int]]], set[int]]:
    """Sampled completions of every prompt (token ids), and the weights' versions that made them."""
    out, versions = [], set()
    for i, prompt in enumerate(prompts):
        r = client.completions.create(model=model_name, prompt=prompt, n=n, max_tokens=max_tokens,
                                      temperature=1.0, seed=seed + i,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
        versions.add(r.model_extra.get("weights_version"))
        out += [(prompt, list(c.token_ids)) for c in r.choices]
    return out, versions


def greedy_tokens(client: Any, model_name: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})  # fmt: skip
    return list(r.choices[0].token_ids), r.model_extra.get("weights_version")


def run_loop(url: str, app_name: str, trainer: Any, model_name: str, prompts: list[list[int]], steps: int,
             n: int = 4, max_tokens: int = 8, check: list[int] | None = None) -> list[dict[str, Any]]:
    """``steps`` rounds of rollout, train step, push; with ``check`` (a prompt): after each push, cbserve's and
    HF's greedy tokens of it (``cbserve`` / ``hf`` in the round's record)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    history = []
    for step in range(1, steps + 1):
        batch, versions = rollouts(client, model_name, prompts, n, max_tokens, seed=100 * step)
        record: dict[str, Any] = {"step": step, "rollout_versions": sorted(versions),
                                  **ray.get(trainer.train_step.remote(batch))}  # fmt: skip
        pushed = ray.get(trainer.push_weights.remote(step))
        record.update(version=pushed["version"], sync_s=pushed["sync_s"], apply_s=pushed["apply_s"])
        if check is not None:
            record["cbserve"], record["served_version"] = greedy_tokens(client, model_name, check, max_tokens)
            record["hf"] = ray.get(trainer.greedy.remote(check, max_tokens))
        history.append(record)
        print(f"step {step}: reward {record['mean_reward']:.3f}, loss {record['loss']:.3f}, "
              f"weights v{record['version']} synced in {record['sync_s'] * 1000:.0f} ms")
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the served model's HF folder (the trainer loads it)")
    parser.add_argument("--model-name", default=None, help="the served model's name (default: the folder's name)")
    parser.add_argument("--app", default="default", help="the Serve app's name")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--target-token", type=int, default=1000)
    parser.add_argument("--transport", choices=["object_store", "group"], default="object_store")
    args = parser.parse_args()
    ray.init(address="auto")
    trainer = Trainer.remote(args.model, args.app, args.target_token, transport=args.transport)
    prompts = [[1, 2, 3, 4], [10, 20, 30], [100, 200, 300, 400, 500]]
    name = args.model_name or args.model.rstrip("/").rsplit("/", 1)[-1]
    run_loop(args.url, args.app, trainer, name, prompts, args.steps)


if __name__ == "__main__":
    main()
