"""One scheduler per process: admission queue, KV slots with prefix reuse, batched steps.

``core`` is the pure part (``Scheduler``: add_request / schedule / update_from_output);
``events`` holds what front ends receive. ``coli.runner.Runner`` connects a scheduler
to a loaded model and is what front ends use.
"""
from coli.scheduler.core import (Request, ScheduledSeq, Scheduler, SchedulerConfig, SeqOutput, Status,
                                 StepPlan)
from coli.scheduler.events import (ContextLengthExceededError, EngineError, Error, Event, Finished, Profile,
                                   PromptLogprobs, QueueFullError, QueueTimeoutError, ReasoningDelta,
                                   RequestCancelledError, Routing, SchedulerClosedError, SchedulerError, Started,
                                   TextDelta, TokenLogprob, ToolCallDelta, Usage)

__all__ = [
    "Request", "ScheduledSeq", "Scheduler", "SchedulerConfig", "SeqOutput", "Status", "StepPlan",
    "ContextLengthExceededError", "EngineError", "Error", "Event", "Finished", "Profile", "PromptLogprobs",
    "QueueFullError", "QueueTimeoutError", "ReasoningDelta", "RequestCancelledError", "Routing",
    "SchedulerClosedError", "SchedulerError", "Started", "TextDelta", "TokenLogprob", "ToolCallDelta", "Usage",
]
