#!/bin/bash
# Second call: diagnostics for the across-replicas mismatch and gemini's tensor-strategy need, beside the fixed tests.
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpuwheels/*.whl > $OUT/pip.txt 2>&1
export PYTHONPATH=/tmp/site
( ZERO_TEST_DEVICE=cuda PYTHONPATH=.gpuwheels:/tmp/site timeout 150 python3 -c "import diag_across; diag_across.main()" > $OUT/diag_across.txt 2>&1
  ZERO_TEST_DEVICE=cuda PYTHONPATH=.gpuwheels:/tmp/site timeout 100 python3 -c "import diag_alloc; diag_alloc.main()" > $OUT/diag_alloc.txt 2>&1 ) &
ZERO_TEST_DEVICE=cuda timeout 250 python3 -m pytest -n 7 -v -p no:cacheprovider --junitxml $OUT/junit.xml \
  tests/test_optimizer_across_replicas.py \
  "tests/test_offload.py::test_the_device_tier_never_exceeds_its_budget" \
  "tests/test_offload.py::test_offloaded_training_equals_plain_training" \
  "tests/test_offload.py::test_evaluation_between_steps_is_not_a_divergence" \
  "tests/test_offload.py::test_the_disk_tier_trains_a_model_whose_states_exceed_the_host_budget" \
  "tests/test_checkpoint.py::test_resume_across_placement_policies" \
  tests/test_robust.py tests/test_idioms.py > $OUT/pytest.txt 2>&1
echo "tests rc $? at $(( $(date +%s) - start )) s" >> $OUT/times.txt
wait
echo "all done $(( $(date +%s) - start )) s" >> $OUT/times.txt
tail -3 $OUT/pytest.txt; cat $OUT/times.txt; cut -c1-600 $OUT/diag_across.txt | head -40; cut -c1-1500 $OUT/diag_alloc.txt
