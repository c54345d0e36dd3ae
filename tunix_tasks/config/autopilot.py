"""`AutopilotConfig`: `actor.autopilot`, the fleet that sizes itself to the learner.

Its knobs bound what `frontdoor/autopilot.py`'s policy may do (docs/scaling.md,
"Autopilot"): the fleet's floor and ceiling (the ceiling is its cost), how much supply it
aims for over the learner's capacity, how big a gap it ignores, and how long it measures
after each change before deciding again.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from tunix_tasks.config.base import Float, Frozen, Int

__all__ = ["MAX_ACTORS", "AutopilotConfig"]

#: The largest fleet a run may ask for (`actor.num_actors`, the autopilot's bounds).
MAX_ACTORS = 1024


class AutopilotConfig(Frozen):
    """Bounds and pace of the autopilot (`mode: async`; `frontdoor/fleet.py`)."""

    enabled: bool | None = Field(
        None,
        description="on (true): the fleet sizes itself during the run so its supply meets "
        "the learner's capacity: `tunix-tasks train` starts and stops actor processes, the "
        "Airflow DAGs start max_actors actors and park those not needed (async mode with "
        "actor.flow_control; docs/scaling.md, 'Autopilot'); off (false): actor.num_actors "
        "actors for the whole run; unset (the default): on where it is safe, in async mode "
        "with flow control on",
    )
    min_actors: Int = Field(1, ge=1, le=MAX_ACTORS, description="the fewest actors it runs")
    max_actors: Int | None = Field(
        None,
        ge=1,
        le=MAX_ACTORS,
        description="the most actors it runs: the fleet's cost ceiling (processes, cores); "
        "unset: actor.num_actors, so the fleet never grows past what the run asks for, "
        "only parks or stops the actors the learner does not need",
    )
    target_supply: Float = Field(
        1.25,
        ge=1.0,
        le=4.0,
        description="actor supply over learner capacity it aims for: above 1 so the learner "
        "does not wait on a slow actor; flow control absorbs the surplus",
    )
    deadband: Float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="a fleet within this fraction of the one the target asks for is left "
        "as it is (no change for small, noisy gaps)",
    )
    cooldown_s: Float = Field(
        60.0,
        gt=0.0,
        le=3600.0,
        description="after a change, measure this long before the next: new actors start, "
        "compile and report their supply first",
    )
    max_factor: Float = Field(
        2.0,
        gt=1.0,
        le=16.0,
        description="one decision grows the fleet at most this many times, or shrinks it "
        "to at least its 1/max_factor",
    )
    interval_s: Float = Field(
        10.0, gt=0.0, le=600.0, description="how often the launcher asks the policy"
    )

    def with_ceiling(self, fleet: int) -> AutopilotConfig:
        """These bounds with `max_actors` set: as configured, else `fleet` (the actors the
        run starts with, or the launcher started). A floor above that ceiling (a launcher
        that started fewer actors than `min_actors`) comes down to it."""
        ceiling = self.max_actors or fleet
        bounds = {"max_actors": ceiling, "min_actors": min(self.min_actors, ceiling)}
        return type(self).model_validate({**self.model_dump(), **bounds})

    @model_validator(mode="after")
    def _check_bounds(self) -> AutopilotConfig:
        if self.max_actors is not None and self.min_actors > self.max_actors:
            raise ValueError(
                f"actor.autopilot.min_actors={self.min_actors} is above "
                f"actor.autopilot.max_actors={self.max_actors}"
            )
        return self
