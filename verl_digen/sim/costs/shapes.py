"""Shapes and FLOPs: the workload's tokens, a forward's and a trained step's FLOPs, parameter
and weight-sync bytes, a trajectory's object-store bytes, a device's efficiency.

Methods of :class:`~verl_digen.sim.cost_model.CostModel` (a mixin: it reads the model's fields
``model``, ``workload``, ``devices``, ``system``, ``reward`` and calls its other methods)."""

from __future__ import annotations

from verl_digen.sim.costs.profiles import DeviceProfile


class WorkloadShapes:
    """Tokens, FLOPs and bytes of the workload on the model."""

    @property
    def text_tokens(self) -> int:
        w = self.workload
        return self.model.text_tokens if w.text_tokens is None else w.text_tokens

    def tokens(self) -> tuple[int, int]:
        """(image or video tokens, sequence length of the self-attention)."""
        m, w = self.model, self.workload
        lat_f = (w.frames - 1) // m.vae_temporal + 1 if m.video else 1
        lat_h, lat_w = w.height // m.vae_spatial, w.width // m.vae_spatial
        image = max(1, lat_f // m.patch_t) * max(1, lat_h // m.patch) * max(1, lat_w // m.patch)
        seq = image + (self.text_tokens if m.joint_text else 0)
        return image, seq

    @property
    def token_params(self) -> float:
        return self.model.token_params or self.model.params

    def linear_flops(self) -> float:
        """FLOPs of the linear layers of one forward on one sample (one CFG branch)."""
        return 2.0 * self.token_params * self.tokens()[1]

    def attention_flops(self) -> float:
        """FLOPs of attention scores and values of one forward on one sample (one branch)."""
        m = self.model
        image, seq = self.tokens()
        flops = 4.0 * m.layers * seq * seq * m.hidden
        if not m.joint_text and self.text_tokens:
            flops += 4.0 * m.layers * image * self.text_tokens * m.hidden  # cross-attention scores/values
        return flops

    def forward_flops(self) -> float:
        """FLOPs of one denoiser forward on one sample (one CFG branch)."""
        return self.linear_flops() + self.attention_flops()

    @property
    def gradient_checkpointing(self) -> bool | None:
        """The configured activation checkpointing: the workload's, else the model profile's;
        None: decided per training pass by memory (:meth:`checkpointing`)."""
        w = self.workload
        return self.model.gradient_checkpointing if w.gradient_checkpointing is None else w.gradient_checkpointing

    def train_flops(self, checkpointing: bool = False) -> float:
        """FLOPs of one trained sample-step (one CFG branch): forward, backward (input gradients
        of every linear layer, weight gradients of the trainable ones only: a frozen LoRA base
        skips them; attention's backward is twice its forward), a recomputed forward with
        activation checkpointing (``checkpointing``), a reference forward with KL."""
        lin, att = self.linear_flops(), self.attention_flops()
        backward_linear = 1.0 if self.workload.lora else 2.0
        flops = lin * (1.0 + backward_linear) + 3.0 * att
        if checkpointing:
            flops += lin + att
        if self.workload.kl:
            flops += lin + att
        return flops

    @property
    def train_flops_factor(self) -> float:
        """Forward-equivalents per trained sample-step (``train_flops / forward_flops``), with
        the configured checkpointing (none when undecided)."""
        return self.train_flops(bool(self.gradient_checkpointing)) / self.forward_flops()

    @property
    def param_bytes(self) -> float:
        return 2.0 * self.model.params  # bf16

    @property
    def trainable_params(self) -> float:
        w, m = self.workload, self.model
        if w.lora:
            return m.lora_params or 2.0 * w.lora_rank * m.hidden * m.lora_linears
        return m.params

    @property
    def sync_bytes(self) -> float:
        return 2.0 * self.trainable_params  # bf16 weights (LoRA factors or the full model)

    def object_store_bytes(self) -> int | None:
        """Bytes of one step's trajectory records (``memory/object_store.py``: each trained step's
        latents, the uint8 pixels; text embeddings not counted, a run with a prompt cache carries
        none), from the family's real configs; None for a model profile without a family."""
        from verl_digen.memory.object_store import latent_elements, trajectory_bytes

        w, family = self.workload, self.model.family
        if not family:
            return None
        window = w.sde_window or w.num_steps
        trained = w.trained_steps
        # a whole window is consecutive steps (window + 1 latents); a subsampled one at most 2 per step
        carried = window + 1 if trained >= window else min(2 * trained, window + 1)
        sample = trajectory_bytes(num_steps=w.num_steps, carried=carried,
                                  latent_elements=latent_elements(family, None, "bf16", w.height, w.width, w.frames),
                                  pixel_elements=3 * w.frames * w.height * w.width)
        return sample.total * w.group_size * w.groups_per_step

    @staticmethod
    def efficiency(dev: DeviceProfile, tokens: float, *, train: bool = False) -> float:
        """Fraction of the peak a forward (or forward+backward) over ``tokens`` tokens reaches:
        ``mfu x t / (t + mfu_half_tokens)``, never above the device's asymptote ``mfu``."""
        m = dev.mfu_train if train else dev.mfu_forward
        h = dev.mfu_half_tokens
        return m * tokens / (tokens + h) if h > 0 and tokens > 0 else m
