#!/bin/bash
# One call on the lent GPU: install, capacity rerun, gemini plan diagnostics, then the CUDA tests not yet run.
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpuwheels/*.whl > $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi -L > $OUT/nvidia.txt 2>&1
python3 -c "import torch, xdist; print(torch.__version__)" >> $OUT/nvidia.txt 2>&1
# 1. the largest model under 4 GiB, after 'one rank releases each chunk after use'
timeout 190 python3 -m zero_bench.gpu --out $OUT/cap --root . --skip bandwidth,gloo,training,tests \
  --capacity-systems zero-gemini,fsdp2-offload --device-budget-gib 4 --budget-s 170 > $OUT/cap.log 2>&1
echo "capacity done $(( $(date +%s) - start )) s" >> $OUT/times.txt
# 2. gemini's plan for the tests' tiny GPT on CUDA, beside the tests
ZERO_TEST_DEVICE=cuda timeout 200 python3 .gpuwheels/diag_gemini.py > $OUT/diag.txt 2>&1 &
# 3. tests: last run's 10 failures, the new across-replicas paths, idioms, robustness, the zoo
left=$(( 540 - ($(date +%s) - start) ))
ZERO_TEST_DEVICE=cuda timeout $left python3 -m pytest -n 8 -v -p no:cacheprovider -p no:randomly --junitxml $OUT/junit.xml \
  "tests/test_offload.py::test_the_device_tier_never_exceeds_its_budget" \
  "tests/test_offload.py::test_offloaded_training_equals_plain_training" \
  "tests/test_offload.py::test_the_tensor_strategy_uses_the_same_policies" \
  "tests/test_offload.py::test_a_budget_below_the_measured_peak_fails_before_the_first_step" \
  "tests/test_offload.py::test_a_full_disk_mid_run_fails_before_the_step_with_the_state_intact" \
  "tests/test_offload.py::test_evaluation_between_steps_is_not_a_divergence" \
  "tests/test_offload.py::test_the_disk_tier_trains_a_model_whose_states_exceed_the_host_budget" \
  "tests/test_checkpoint.py::test_resume_across_placement_policies" \
  "packages/offload/tests/test_offload_units.py::TestStaticConformance" \
  tests/test_optimizer_across_replicas.py tests/test_idioms.py tests/test_robust.py \
  "tests/test_parity.py::test_zoo_parity" > $OUT/pytest.txt 2>&1
echo "tests rc $? at $(( $(date +%s) - start )) s" >> $OUT/times.txt
wait
echo "all done $(( $(date +%s) - start )) s" >> $OUT/times.txt
tail -5 $OUT/pytest.txt; cat $OUT/times.txt; cat $OUT/diag.txt | tail -8; tail -30 $OUT/cap/report.md 2>/dev/null
