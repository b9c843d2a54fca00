"""Request bodies of the API (responses are the plain JSON views of views.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RunRequest(BaseModel):
    """A run to create. Every field is optional; defaults are the paper's MNIST settings."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    algo: Literal["gem", "downpour", "adaptive", "dcasgd"] = "gem"
    proxy: Literal["local", "global"] = "local"
    lr: float = Field(0.05, gt=0, le=10)
    momentum: float = Field(0.9, ge=0, lt=1)
    kappa: float = Field(1.0, gt=0, le=100)
    pi_max: float = Field(5.0, gt=0, le=1e6)
    batch_size: int = Field(64, ge=1, le=65536)
    model: str = Field("cnn", min_length=1, max_length=200)
    dataset: str = Field("mnist5k", min_length=1, max_length=500)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    epochs: float | None = Field(None, gt=0, le=100_000)
    steps: int | None = Field(None, ge=1, le=10**9)
    max_staleness: int = Field(512, ge=0, le=10**6)
    max_pending: int = Field(64, ge=1, le=10**6)
    wire_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    publish_every: int = Field(1, ge=1, le=4096)
    publish_interval_ms: int = Field(0, ge=0, le=60_000)
    start: bool = True

    @model_validator(mode="after")
    def _one_budget(self) -> RunRequest:
        if self.epochs is not None and self.steps is not None:
            raise ValueError("give epochs or steps, not both")
        return self

    def settings(self) -> dict[str, object]:
        """The RunConfig fields of this request."""
        return self.model_dump(exclude={"run_id", "epochs", "steps", "start"})
