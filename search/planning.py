"""The step model's arithmetic below the user API: assignments and their simulation, budgets against a device,
pipeline stages and schedules, plan matching and documents; what the adaptive loop, the CLI and the bench build on.

Not part of the user API (``search.__all__``); adaptive-mem's other packages import these from here.
"""

from ._assignment import Assignment
from ._budget import activation_peak, check_feasible, device_capacity, device_shortfall, keep_all, min_candidates
from ._collectives import data_parallel_comm
from ._match import check_plan_matches
from ._pipeline import (Stage, StageStatic, busiest_stage, rank_peak, split_layout, split_stages, stage_static,
                        stage_statics)
from ._plan import KEEP, matches
from ._reserve import reserved_at_peak
from ._scaling import keep_all_step_time
from ._plan_buckets import bucketed_plan
from ._seq_profiles import profiles_by, seq_len_profiles, structure_of
from ._seq_scaling import (SEQ_SCALING_TOLERANCE, SeqLenBucketError, SeqScalingCheck, parse_seq_lens,
                           profile_for_seq_len, scale_to_seq_len, score_ops, seq_len_bucket, seq_scaling_error)
from ._schedules import chunk_layers, in_flight, pipeline_step_time
from ._simulator import resolve, segments, simulate_assignment
from ._solver import fmt_seconds, plan_from_assignment
from ._throughput import parse_batch_sizes
from ._timeline import Interval, Timeline
from ._yaml import load_document

__all__ = ["Assignment", "Interval", "KEEP", "SEQ_SCALING_TOLERANCE", "SeqLenBucketError", "SeqScalingCheck", "Stage",
           "StageStatic", "Timeline", "activation_peak", "bucketed_plan", "busiest_stage",
           "check_feasible",
           "check_plan_matches", "chunk_layers", "data_parallel_comm", "device_capacity", "device_shortfall",
           "fmt_seconds", "in_flight", "keep_all", "keep_all_step_time", "load_document", "matches",
           "min_candidates", "parse_batch_sizes", "parse_seq_lens", "profile_for_seq_len", "pipeline_step_time",
           "plan_from_assignment", "rank_peak", "reserved_at_peak",
           "resolve",
           "profiles_by", "scale_to_seq_len", "score_ops", "segments", "seq_len_bucket", "seq_len_profiles", "seq_scaling_error",
           "simulate_assignment", "split_layout", "split_stages", "stage_static", "stage_statics", "structure_of"]
