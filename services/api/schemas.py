"""Request bodies of the API (responses are the plain JSON views of views.py).

``RunRequest`` is built from gemq.config's table of user settings: its defaults, bounds,
choices and descriptions are those of ``RunConfig`` and of the ``gemq`` flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from gemq.config import AUTO, PLANNED_WORKERS, USER_SETTINGS, Setting
from gemq.ids import RUN_ID_PATTERN


class _RunRequestBase(BaseModel):
    """A run to create. Every field is optional; defaults are the paper's MNIST settings."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(None, pattern=f"^{RUN_ID_PATTERN.pattern}$",
                               description="default: run-<date>-<time>-<random>")
    start: bool = Field(True, description="enqueue the aggregation at once")
    workers: int = Field(PLANNED_WORKERS, ge=1, le=100_000, strict=True,
                         description="workers you plan to run: what the settings left at "
                                     "auto are sized for")

    @model_validator(mode="after")
    def _one_budget(self) -> _RunRequestBase:
        if getattr(self, "epochs", None) is not None and getattr(self, "steps", None) is not None:
            raise ValueError("give epochs or steps, not both")
        return self

    def settings(self) -> dict[str, Any]:
        """The run settings of this request (gemq.config.make_config's input)."""
        return self.model_dump(exclude={"start", "workers"})


def _field(setting: Setting) -> tuple[Any, Any]:
    """The pydantic (type, Field) of one setting."""
    bounds: dict[str, Any] = {}
    if setting.low is not None:
        bounds["gt" if setting.low_open else "ge"] = setting.kind(setting.low)
    if setting.high is not None:
        bounds["lt" if setting.high_open else "le"] = setting.kind(setting.high)
    if setting.kind is str and setting.choices is None:
        bounds.update(min_length=1, max_length=setting.max_length)
    if setting.kind in (int, float) and not setting.choices:
        # As the CLI takes them: a number, not true or "64" (strict: an int is a float too),
        # and a finite one (JSON's NaN, Infinity and 1e309 parse as floats).
        bounds.update(strict=True)
        if setting.kind is float:
            bounds.update(allow_inf_nan=False)
    kind: Any = Literal[setting.choices] if setting.choices else setting.kind
    if setting.auto:  # a value, or "auto": gemq chooses it when the run is created
        if setting.choices:
            return Literal[setting.offered_choices], Field(AUTO, description=setting.help)
        return (Annotated[kind, Field(**bounds)] | Literal[AUTO],
                Field(AUTO, description=setting.help))
    if setting.default is None:
        kind = kind | None
    return kind, Field(setting.default, description=setting.help, **bounds)


if TYPE_CHECKING:
    RunRequest = _RunRequestBase
else:
    RunRequest = create_model("RunRequest", __base__=_RunRequestBase,
                              __doc__=_RunRequestBase.__doc__,
                              **{s.name: _field(s) for s in USER_SETTINGS})
