#!/usr/bin/env bash
# The converged CPU benchmark (issue 21): the small preset (MultiLeNet, Multi-MNIST 28 px) on a 2-core CPU.
#   bash scripts/reproduce_small.sh [2|3|sweep|runoff|sweep3|runoff3|moco-sweep|ablations|ablations-replication|features|features-sweep|features-runoff|features-swept|k4|k9|k9-all|k4-sweep|k4-runoff|k4-swept|k9-sweep|k9-runoff|k9-swept|common-rate|controls|b64-sweep|b64-runoff|b64|attributes|attributes-key|attributes-sweep|attributes-runoff|dr-path|dr-path-rates|attributes-dr-path|attributes-dr-path-rates]
#   (default 2; set up .venv first: bash scripts/setup_env.sh)
# 2:     8 methods x 5 seeds on 2 digits, MoCo with the paper's ema 0.95, the two reference rows (equal
#        weights on the DR dual; MGDA with the exact min-norm solver), Double-Clip with the samples of
#        one-batch methods (353 iterations of 2 batches = 705 of 1), and the App. F.1 lambda ablation for
#        Double-Clip (0.4, 0.8, 1.6, and 100); results in results/multimnist2-small/.
# 3:     8 methods x 5 seeds on 3 digits and MoCo with ema 0.95; results in results/multimnist3-small/.
# sweep: the learning-rate sweep on the validation split of the training digits (seed 0), whose winners
#        are SMALL_LR["multimnist2"] in python/drmoo/experiments/multimnist.py; results in results/multimnist2-small/lr-sweep/.
#        MoCo is swept there with the paper's ema 0.95.
# sweep3: the same learning-rate sweep on 3 digits (seed 0; MoCo with the preset's ema), whose winners are
#        SMALL_LR["multimnist3"]; results in results/multimnist3-small/lr-sweep/.
# runoff: the sweep's second stage on 2 digits: each method's two best rates of sweep, run on seeds 1 and 2
#        too; the winner has the best mean over seeds 0-2 (seed 0: sweep's run); MoCo is not in it (its own
#        3-seed sweep is moco-sweep); results in results/multimnist2-small/lr-sweep/runoff/.
# runoff3: the sweep's second stage on 3 digits: each method's two best rates of sweep3, run on seeds 1 and 2
#        too; the winner has the best mean over seeds 0-2 (seed 0: sweep3's run); results in
#        results/multimnist3-small/lr-sweep/runoff/.
# moco-sweep: MoCo's (ema, lr) sweep on the validation split, seeds 0-2, whose winner is SMALL_MOCO_EMA and
#        SMALL_LR["multimnist2"]["moco"]; the grid is extended (as the rate sweeps are) while the best
#        setting sits at an end of it: ema 0.8 past the first winner (0.9, 0.3), then lr 0.1 and ema 0.6
#        (1 - ema doubling) past the second (0.8, 0.2); results in results/multimnist2-small/moco-sweep/.
# ablations: the mechanism controls of issue 27, 5 seeds, paired against Double-Clip (retrained here: the
#        committed runs keep no checkpoint, so a comparison cannot reuse them): Double-Clip without its
#        preference update (pref_lr=0), also without DR (lam=100), MGDA at Double-Clip's step length (its lr
#        1.0 and theta clip c1 = 1.0, c2 = 0.5), MGDA at that rate without the clip (lr 1.0: the missing arm
#        that parts the rate from the clip) and MGDA without DR (lam=100); results in
#        results/multimnist2-small/ablations/.
# ablations-replication: the step-length rows of ablations (Double-Clip, MGDA, MGDA with Double-Clip's lr and
#        clip, MGDA at lr 1.0 alone) on five further seeds, 5-9, that no verdict was written from (issue 36
#        item 6); results in results/multimnist2-small/ablations/replication/.
# features: issue 26's accuracy check of jacobian="features": Double-Clip, MGDA, FAMO and Nash-MTL in
#        features mode, 5 seeds, at their comparison rates; paired against the same methods' committed
#        parameters-mode runs by scripts/small_controls.py (features/vs-parameters.{csv,md});
#        results in results/multimnist2-small/features/.
# features-sweep, features-runoff, features-swept: the two-stage validation sweep of the two methods whose
#        features-mode step depends on the Gram's scale (Double-Clip's theta clip, Nash-MTL's 1/|g_i|
#        weights), run in features mode (the grid 0.001-3, extended by the ladder while the best rate sits at an
#        end), then 5 test seeds at the winners, paired against the parameters-mode runs by
#        scripts/small_controls.py; results in results/multimnist2-small/features/lr-sweep/ and
#        results/multimnist2-small/features/swept/.
# k4:    issue 26's many-task comparison on Multi-MNIST-4 (30 epochs), 3 seeds: all eight methods in
#        parameters mode, and in features mode every method that has it (MoCo refuses it).  Rates: the
#        preset's (SMALL_LR, the 3-digit rates); features mode keeps them where its step is the exact
#        lift of J_z^T w (the trunk gets the gradient of sum_i c_i L^i either way) and takes the
#        features-swept 2-digit winners (features-sweep/-runoff) for Double-Clip and Nash-MTL, whose step
#        length reads the Gram's scale; results in results/multimnist-k-small/multimnist4/.
# k9:    the same on Multi-MNIST-9 (40 epochs), 3 seeds, every row but three: all eight methods in features
#        mode where they have it, and in parameters mode all but MoDo, SDMGrad and Double-Loop, whose
#        9-task parameters-mode step draws several batches and costs 3-4 MGDA steps (~5 h of this CPU for
#        the nine runs); results in results/multimnist-k-small/multimnist9/.
# k9-all: k9's rows plus those three (the full comparison, as k4); reuses k9's finished runs.
# k4-sweep, k4-runoff, k4-swept (and the same for k9): Double-Clip's and Nash-MTL's features-mode rates
#        swept at k = 4 (9) itself (the two-stage validation rule of features-sweep, grid 0.01-1 centred on
#        the 2-digit winners), then the winners on the test digits, 3 seeds, where they differ from the
#        2-digit rates; the pairing with parameters mode gains their rows; results in
#        results/multimnist-k-small/multimnist<k>/features-lr-sweep/ and .../multimnist<k>/features-swept/.
# common-rate: Double-Clip at the common trunk rate 0.3 (the other rows of the rate-sensitivity table have
#        committed runs at 0.3: MoCo's at its first choice, ema 0.9); results in results/multimnist2-small/common-rate/.
# controls: tabulates rate-sensitivity.{csv,md} and ablations/contrasts.csv from the committed runs
#        (scripts/small_controls.py), Holm's correction over each verdict's intervals
#        (multiple-comparisons.csv, scripts/multiple_comparisons.py) and the stopped or collapsed runs of
#        every row (results/divergences.csv, scripts/divergences.py); no training.
# b64-sweep, b64-runoff, b64: a second training regime (batch 64, 1,200 iterations) for Double-Clip, MGDA,
#        Nash-MTL and FAMO: the two-stage validation sweep, then 5 test seeds; results in
#        results/multimnist2-small/batch64/.
# attributes: Table 2's protocol on real digits (issue 36): --experiment mnist-attributes (8 imbalanced,
#        co-occurring binary attributes of 2-digit composites, the paper's importance weights on the dual),
#        SEEDS (default 0,1,2,3,4): the eight methods, Double-Clip and MGDA without DR (lam=100) and the plain
#        reference (equal weights, lam=100: mgda[lam=100,pref_lr=0]); then Double-Clip, MGDA and the plain
#        reference without the importance weights (mnist-attributes-unweighted); then the paired contrasts
#        (scripts/attribute_contrasts.py).  Rates: the key rows run at the preset's rates (the 2-digit
#        Multi-MNIST small preset's) and at the validation winners (see attributes-key); the six other methods
#        only at their winners, so attributes-sweep and attributes-runoff must have run first.  Results in
#        results/mnist-attributes-small/{weighted,unweighted}/ and contrasts.{csv,md}.
# attributes-sweep, attributes-runoff: the two-stage validation rule (scripts/sweep_rule.py; ranked by the
#        prevalence set's mean balanced accuracy) for the eight methods and the plain reference (MoCo with the
#        preset's tracking weight), grid 0.1-3 extended while a best rate sits at an end; results in
#        results/mnist-attributes-small/lr-sweep/ (runoff/: stage 2), the winners printed at the end.
# attributes-key: attributes' rows that answer "does DR help" (Double-Clip, MGDA, their lam=100 rows, the
#        plain reference, each with and without the weights), seed by seed, so an interrupted call has whole seeds.
#        Once attributes-runoff has run, both targets add the key rows at the rates it chose where those differ
#        from the preset's (sweep_rule.py tuned: e.g. mgda[lr=1.0]), their twins without the importance weights
#        and, for Double-Clip and MGDA, their lam=100 twins at those rates, so "what wins", "does DR help" and
#        "do the weights help" are asked at tuned rates too.
# dr-path: what DR changes on 2 digits, metric by metric: Double-Clip at lam 0.1, 0.3, 0.8 (the paper's), 3 and 100
#        (DR off: the chi^2 dual then within a few percent of the mean loss), and MGDA at lam 0.8 and 100, 5 paired
#        seeds, each at the preset's rate (Double-Clip: the lam 0.8 row's validated 1.0; MGDA: its validated 0.1,
#        that of the 2-digit comparison); every run scored with drmoo eval's robustness metrics (tail,
#        worst case, calibration, worst digit, FGSM, label shift, pixel noise, the fitted temperature: compare's
#        dr-table.csv), then scripts/dr_path.py (contrasts.csv: each lam against the same method's lam 100 and
#        against that with its temperature) and Holm's correction over those contrasts; results in
#        results/multimnist2-small/dr-path/.
# dr-path-rates: each row of dr-path at its own rate, chosen on the validation split by the project's two-stage
#        rule on a smaller grid around the lam 0.8 winners: stage 1 (seed 0, no FGSM) runs Double-Clip at
#        lam 0.1, 0.3, 3 and 100 (LAMS) at 0.3, 1 and 3 (around 1.0) and MGDA at lam 100 at 0.03, 0.1 and 0.3
#        (around 0.1), the grid grown while a best rate sits at an end; stage 2 (seeds 1 and 2) runs each row's
#        two best; the winner has the best mean over seeds 0-2.  Then the path is rerun at the winners on the
#        5 test seeds with the FGSM grid (runs at dr-path's rates copied from it), dr_path.py and Holm; results
#        in results/multimnist2-small/dr-path/lr-sweep/ (the choice) and results/multimnist2-small/dr-path-tuned/.
# attributes-dr-path: the same lam path on the attributes, with the importance weights (mnist-attributes) and
#        without (mnist-attributes-unweighted): Double-Clip at lam 0.1, 0.3, 0.8, 3 and 100 at its validated rate
#        1.0 (the preset's), MGDA at lam 0.8 and 100 at its validated 0.3, 5 paired seeds, run seed by seed so
#        that an interrupted call leaves whole seeds; every run scored with the robustness metrics (tail, worst
#        case under the empirical and the label-balancing nominal, calibration, the worse label, label shift,
#        pixel noise, the fitted temperature), then scripts/dr_path.py and Holm's correction per set-up;
#        results in results/mnist-attributes-small/dr-path/{weighted,unweighted}/.
# attributes-dr-path-rates: each row of attributes-dr-path at its own rate, chosen on the validation split by the
#        project's two-stage rule on a smaller grid around the lam 0.8 winners: stage 1 (seed 0) runs Double-Clip
#        at each lam at 0.3, 1 and 3 (around 1.0) and MGDA at lam 100 at 0.1, 0.3 and 1 (around 0.3), the grid grown
#        while a best rate sits at an end (scripts/sweep_rule.py extension); stage 2 (seeds 1 and 2) runs each
#        row's two best; the winner has the best mean over seeds 0-2.  Lam 0.8 is swept in the unweighted set-up
#        only (the weighted one's is results/mnist-attributes-small/lr-sweep/).  SETUPS="weighted unweighted"
#        (default both), LAMS="0.1 0.3 3 100" (Double-Clip's).  Then each set-up's path is rerun at the winners
#        on the 5 test seeds (runs at the path's own rates reused from its folder), dr_path.py and Holm;
#        results in results/mnist-attributes-small/dr-path/{weighted,unweighted}/lr-check/ (the choice) and
#        results/mnist-attributes-small/dr-path/{weighted,unweighted}-tuned/ (the path at the chosen rates).
# Finished runs are reused, so an interrupted call continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
drmoo="${DRMOO_VENV:-.venv}/bin/drmoo"
python="${DRMOO_VENV:-.venv}/bin/python"
jobs="${JOBS:-$(nproc)}"
eps="0,0.01,0.03,0.05,0.08,0.1,0.15,0.2"
what="${1:-2}"
start=$(date +%s)
# A validation-split sweep: sweep EXPERIMENT SEEDS OUT SPEC [COMPARE OPTIONS...] (every stage of every
# sweep runs through it).
sweep() {
    local clean=(--eps 0)
    case "$1" in mnist-attributes*) clean=() ;; esac  # a clean evaluation already: no FGSM to switch off
    "$drmoo" compare --experiment "$1" --preset small --eval-split validation --seeds "$2" "${clean[@]}" \
        --jobs "$jobs" --methods "$4" --device cpu --quiet --out "$3" \
        ${DRMOO_SWEEP_CACHE:+--cache-dir "$DRMOO_SWEEP_CACHE"} "${@:5}"
}
# A first stage on seed 0 whose grid grows while a best rate sits at an end of it (sweep_rule.py's
# extension): grown_sweep EXPERIMENT OUT SPEC [COMPARE OPTIONS...].
grown_sweep() {
    local experiment="$1" out="$2" spec="$3" more
    shift 3
    while :; do
        sweep "$experiment" 0 "$out" "$spec" "$@"
        more=$("$python" scripts/sweep_rule.py extension "$out")
        [ -n "$more" ] || break
        spec="$spec,$more"
    done
}
# one_row METHOD SPEC: METHOD's row of a spec whose rows all carry [...] (sweep_rule.py's output).
one_row() { sed 's/\],/]\n/g' <<< "$2" | grep "^$1\["; }
# lam_rate_grid DC_LAMS DC_RATES MGDA_LAMS MGDA_RATES: stage 1 of a lam path's rate check, Double-Clip at
# each of DC_LAMS and MGDA at each of MGDA_LAMS, each at every rate of its grid.  Lam 0.8 is the methods'
# default: its rows name no lam, as the path's do, so that their runs are reused.
lam_rate_grid() {
    local spec="" method lams rates lam lr setting
    for method in double-clip mgda; do
        lams="$1" rates="$2"
        [ "$method" = double-clip ] || lams="$3" rates="$4"
        for lam in $lams; do
            setting="lam=$lam,"
            [ "$lam" != 0.8 ] || setting=""
            for lr in $rates; do spec="$spec${spec:+,}$method[${setting}lr=$lr]"; done
        done
    done
    echo "$spec"
}
# path_at_own_rates EXPERIMENT ROWS OUT SOURCES [COMPARE OPTIONS...]: a lam path at each row's chosen rate, 5 test
# seeds, into OUT (a *-tuned folder: dr_path.py pairs each row with its method's lam 100 row whatever their rates);
# a run of ROWS that a folder of SOURCES (space-separated) has finished is copied in, not redone; then the
# contrasts and Holm's correction.
path_at_own_rates() {
    local experiment="$1" rows="$2" out="$3" sources="$4" reference run source
    shift 4
    reference=$(sed 's/\],/]\n/g' <<< "$rows" | grep '^double-clip\[lam=100[],]')
    mkdir -p "$out"
    for run in $("$python" -c 'import sys; from drmoo.experiments.variants import parse_variants, run_dir_name
print(*(run_dir_name(v.name, s) for v in parse_variants(sys.argv[1]) for s in range(5)))' "$rows"); do
        for source in $sources; do
            [ -e "$out/$run" ] || [ ! -e "$source/$run/done" ] || cp -r "$source/$run" "$out/"
        done
    done
    "$drmoo" compare --experiment "$experiment" --preset small --seeds 0,1,2,3,4 --jobs "$jobs" \
        --methods "$rows" --reference "$reference" --device cpu --quiet --out "$out" "$@" > /dev/null
    "$python" scripts/dr_path.py "$out"
    "$python" scripts/multiple_comparisons.py "$out"
}
# both_modes SWEPT [METHOD...]: the spec of each method's parameters-mode row and features-mode row
# (MoCo has none) for the many-task comparisons, the rates as k4's description above says (SWEPT:
# sweep_rule.py's features-mode winners).  A method given as -METHOD gets its features row only.
both_modes() {
    local swept="$1" method rows=""
    shift
    for method in "$@"; do
        [ "${method#-}" = "$method" ] && rows="$rows${rows:+,}$method"
        method="${method#-}"
        case "$method" in
            moco) ;;
            double-clip|nashmtl) rows="$rows${rows:+,}$(one_row "$method" "$swept")" ;;
            *) rows="$rows${rows:+,}$method[jacobian=features]" ;;
        esac
    done
    echo "$rows"
}
# The second training regime: batch 64, 1,200 iterations (7 epochs of 188 iterations, cut at 1,200).
b64="--batch-size 64 --epochs 7 --max-steps 1200"
case "$what" in
2)
    "$drmoo" compare --experiment multimnist2 --preset small --seeds 0,1,2,3,4 --eps "$eps" --jobs "$jobs" \
        --methods "all,moco[ema=0.95,lr=0.3],mgda[pref_lr=0],mgda[solver=min_norm],double-clip[max_steps=353],double-clip[lam=0.4],double-clip[lam=1.6],double-clip[lam=100]" \
        --device cpu --quiet --out results/multimnist2-small ;;
3)
    "$drmoo" compare --experiment multimnist3 --preset small --seeds 0,1,2,3,4 --eps "$eps" --jobs "$jobs" \
        --methods "all,moco[ema=0.95,lr=0.3]" --device cpu --quiet --out results/multimnist3-small ;;
ablations)
    "$drmoo" compare --experiment multimnist2 --preset small --seeds 0,1,2,3,4 --eps "$eps" --jobs "$jobs" \
        --methods "double-clip,double-clip[pref_lr=0],double-clip[lam=100,pref_lr=0],mgda[lr=1.0,clip_c1=1.0,clip_c2=0.5],mgda[lr=1.0],mgda[lam=100]" \
        --device cpu --quiet --out results/multimnist2-small/ablations ;;
ablations-replication)
    "$drmoo" compare --experiment multimnist2 --preset small --seeds 5,6,7,8,9 --eps "$eps" --jobs "$jobs" \
        --methods "double-clip,mgda,mgda[lr=1.0,clip_c1=1.0,clip_c2=0.5],mgda[lr=1.0]" \
        --device cpu --quiet --out results/multimnist2-small/ablations/replication ;;
features)
    "$drmoo" compare --experiment multimnist2 --preset small --seeds 0,1,2,3,4 --eps "$eps" --jobs "$jobs" \
        --methods "double-clip[jacobian=features],mgda[jacobian=features],famo[jacobian=features],nashmtl[jacobian=features]" \
        --reference "double-clip[jacobian=features]" --device cpu --quiet --out results/multimnist2-small/features
    "$python" scripts/small_controls.py results/multimnist2-small ;;
features-sweep)
    spec=""
    # A wider grid than parameters mode's 0.1-3: how far the step's scale moves is not known beforehand
    # (it goes with |dz/dtheta| / |J_z|), and a first run of Nash-MTL on 0.1-10 stayed at chance at every rate.
    for method in double-clip nashmtl; do
        for lr in 0.001 0.003 0.01 0.03 0.1 0.3 1.0 3.0; do spec="$spec${spec:+,}$method[jacobian=features,lr=$lr]"; done
    done
    grown_sweep multimnist2 results/multimnist2-small/features/lr-sweep "$spec" ;;
features-runoff)
    spec=$("$python" scripts/sweep_rule.py finalists results/multimnist2-small/features/lr-sweep)
    sweep multimnist2 1,2 results/multimnist2-small/features/lr-sweep/runoff "$spec" ;;
features-swept)
    spec=$("$python" scripts/sweep_rule.py winners results/multimnist2-small/features/lr-sweep)
    reference=$(one_row double-clip "$spec")
    "$drmoo" compare --experiment multimnist2 --preset small --seeds 0,1,2,3,4 --eps "$eps" --jobs "$jobs" \
        --methods "$spec" --reference "$reference" --device cpu --quiet --out results/multimnist2-small/features/swept
    "$python" scripts/small_controls.py results/multimnist2-small ;;
k4)
    swept=$("$python" scripts/sweep_rule.py winners results/multimnist2-small/features/lr-sweep)
    spec=$(both_modes "$swept" mgda double-clip famo nashmtl moco modo sdmgrad double-loop)
    "$drmoo" compare --experiment multimnist4 --preset small --seeds 0,1,2 --eps "$eps" --jobs "$jobs" \
        --methods "$spec" --device cpu --quiet --out results/multimnist-k-small/multimnist4
    "$python" scripts/small_controls.py modes results/multimnist-k-small/multimnist4 ;;
k9|k9-all)
    swept=$("$python" scripts/sweep_rule.py winners results/multimnist2-small/features/lr-sweep)
    # The cheap rows first (compare trains row by row), so an interrupted k9-all has them.
    spec=$(both_modes "$swept" mgda double-clip famo nashmtl moco -modo -sdmgrad -double-loop)
    [ "$what" = k9-all ] && spec="$spec,modo,sdmgrad,double-loop"
    "$drmoo" compare --experiment multimnist9 --preset small --seeds 0,1,2 --eps "$eps" --jobs "$jobs" \
        --methods "$spec" --device cpu --quiet --out results/multimnist-k-small/multimnist9
    "$python" scripts/small_controls.py modes results/multimnist-k-small/multimnist9 ;;
k4-sweep|k9-sweep)
    # Double-Clip's and Nash-MTL's features-mode rates swept at k = 4 or 9 itself (k4's and k9's rows use
    # the 2-digit winners, 0.1 and 0.03): a grid centred on those, grown by the rule while a best rate sits
    # at an end.
    k="${what:1:1}"
    spec=""
    for method in double-clip nashmtl; do
        for lr in 0.01 0.03 0.1 0.3 1.0; do spec="$spec${spec:+,}$method[jacobian=features,lr=$lr]"; done
    done
    grown_sweep "multimnist$k" "results/multimnist-k-small/multimnist$k/features-lr-sweep" "$spec" ;;
k4-runoff|k9-runoff)
    k="${what:1:1}"
    spec=$("$python" scripts/sweep_rule.py finalists "results/multimnist-k-small/multimnist$k/features-lr-sweep")
    sweep "multimnist$k" 1,2 "results/multimnist-k-small/multimnist$k/features-lr-sweep/runoff" "$spec" ;;
k4-swept|k9-swept)
    # The winners on the test digits, 3 seeds, where they differ from the 2-digit rates k4/k9 already ran;
    # small_controls.py pairs them with the comparison's parameters-mode rows (vs-parameters.md).
    k="${what:1:1}"
    swept=$("$python" scripts/sweep_rule.py winners results/multimnist2-small/features/lr-sweep)
    spec=""
    for row in $(sed 's/\],/]\n/g' <<< "$("$python" scripts/sweep_rule.py winners \
            "results/multimnist-k-small/multimnist$k/features-lr-sweep")"); do
        grep -qxF "$row" <<< "$(sed 's/\],/]\n/g' <<< "$swept")" || spec="$spec${spec:+,}$row"
    done
    if [ -n "$spec" ]; then
        "$drmoo" compare --experiment "multimnist$k" --preset small --seeds 0,1,2 --eps "$eps" --jobs "$jobs" \
            --methods "$spec" --device cpu --quiet --out "results/multimnist-k-small/multimnist$k/features-swept"
    else
        echo "[reproduce_small $what] the k = $k winners are the 2-digit rates: k$k's rows already hold them"
    fi
    "$python" scripts/small_controls.py modes "results/multimnist-k-small/multimnist$k" ;;
common-rate)
    "$drmoo" compare --experiment multimnist2 --preset small --seeds 0,1,2,3,4 --eps "$eps" --jobs "$jobs" \
        --methods "double-clip[lr=0.3]" --device cpu --quiet --out results/multimnist2-small/common-rate ;;
controls)
    "$python" scripts/small_controls.py results/multimnist2-small
    "$python" scripts/multiple_comparisons.py results/multimnist2-small results/multimnist3-small
    "$python" scripts/divergences.py results ;;
b64-sweep)
    # The 2-digit grid, extended by the rule while a method's best rate sits at an end of it.
    spec=""
    for method in double-clip mgda nashmtl famo; do
        for lr in 0.1 0.3 1.0 3.0; do spec="$spec${spec:+,}$method[lr=$lr]"; done
    done
    # shellcheck disable=SC2086
    grown_sweep multimnist2 results/multimnist2-small/batch64/lr-sweep "$spec" $b64 ;;
b64-runoff)
    spec=$("$python" scripts/sweep_rule.py finalists results/multimnist2-small/batch64/lr-sweep)
    # shellcheck disable=SC2086
    sweep multimnist2 1,2 results/multimnist2-small/batch64/lr-sweep/runoff "$spec" $b64 ;;
b64)
    spec=$("$python" scripts/sweep_rule.py winners results/multimnist2-small/batch64/lr-sweep)
    reference=$(one_row double-clip "$spec")
    # shellcheck disable=SC2086
    "$drmoo" compare --experiment multimnist2 --preset small $b64 --seeds 0,1,2,3,4 --eps "$eps" --jobs "$jobs" \
        --methods "$spec" --reference "$reference" --device cpu --quiet --out results/multimnist2-small/batch64 ;;
attributes-sweep)
    spec=""
    for row in double-clip mgda "mgda[lam=100,pref_lr=0" double-loop modo moco sdmgrad nashmtl famo; do
        for lr in 0.1 0.3 1.0 3.0; do
            case "$row" in *"["*) spec="$spec${spec:+,}$row,lr=$lr]" ;; *) spec="$spec${spec:+,}$row[lr=$lr]" ;; esac
        done
    done
    grown_sweep mnist-attributes results/mnist-attributes-small/lr-sweep "$spec" ;;
attributes-runoff)
    spec=$("$python" scripts/sweep_rule.py finalists results/mnist-attributes-small/lr-sweep)
    sweep mnist-attributes 1,2 results/mnist-attributes-small/lr-sweep/runoff "$spec"
    echo "winners: $("$python" scripts/sweep_rule.py winners results/mnist-attributes-small/lr-sweep)" ;;
attributes|attributes-key)
    seeds="${SEEDS:-0,1,2,3,4}"
    plain="mgda[lam=100,pref_lr=0]"
    # the rows at the validation sweep's winning rates that the preset rows do not already cover (empty
    # until both stages of the sweep have run)
    tuned=$("$python" scripts/sweep_rule.py tuned results/mnist-attributes-small/lr-sweep mnist-attributes \
        double-clip mgda "$plain" 2> /dev/null || true)
    unweighted="double-clip,mgda,$plain${tuned:+,}$tuned"  # the weights' ablation at the tuned rates too
    while read -r row; do  # DR at a tuned rate: the row's lam=100 twin
        case "$row" in double-clip\[lr=*|mgda\[lr=*) tuned="$tuned,${row%%\[*}[lam=100,${row#*\[}" ;; esac
    done < <(sed 's/\],/]\n/g' <<< "$tuned")
    tuned="${tuned:+,}$tuned"
    attributes() {  # attributes EXPERIMENT SEEDS ROWS OUT
        "$drmoo" compare --experiment "$1" --preset small --seeds "$2" --jobs "$jobs" --methods "$3" --device cpu \
            --quiet --out "$4" > /dev/null
    }
    if [ "$what" = attributes-key ]; then
        done_seeds=""
        for seed in ${seeds//,/ }; do  # seed by seed: the comparisons reuse the seeds already run
            done_seeds="$done_seeds${done_seeds:+,}$seed"
            attributes mnist-attributes "$done_seeds" "double-clip,mgda,double-clip[lam=100],mgda[lam=100],$plain$tuned" \
                results/mnist-attributes-small/weighted
            attributes mnist-attributes-unweighted "$done_seeds" "$unweighted" results/mnist-attributes-small/unweighted
            "$python" scripts/attribute_contrasts.py results/mnist-attributes-small > /dev/null
        done
    else
        # the six other methods at their validation winners (the preset's own name where that is the rate)
        if ! others=$("$python" scripts/sweep_rule.py rows results/mnist-attributes-small/lr-sweep mnist-attributes \
                double-loop modo moco sdmgrad nashmtl famo) || [ -z "$others" ]; then
            echo "attributes: the six other methods' rates come from the validation sweep: run attributes-sweep" \
                "and attributes-runoff first" >&2
            exit 2
        fi
        attributes mnist-attributes "$seeds" "double-clip,mgda,double-clip[lam=100],mgda[lam=100],$plain$tuned,$others" \
            results/mnist-attributes-small/weighted
        attributes mnist-attributes-unweighted "$seeds" "$unweighted" results/mnist-attributes-small/unweighted
    fi
    "$python" scripts/attribute_contrasts.py results/mnist-attributes-small ;;
attributes-dr-path-rates)
    for setup in ${SETUPS:-weighted unweighted}; do
        experiment=mnist-attributes dc_lams="${LAMS:-0.1 0.3 3 100}" mgda_lams=100
        if [ "$setup" = unweighted ]; then
            experiment=mnist-attributes-unweighted dc_lams="$dc_lams 0.8" mgda_lams="0.8 100"
        fi
        check="results/mnist-attributes-small/dr-path/$setup/lr-check"
        grown_sweep "$experiment" "$check" "$(lam_rate_grid "$dc_lams" "0.3 1.0 3.0" "$mgda_lams" "0.1 0.3 1.0")"
        sweep "$experiment" 1,2 "$check/runoff" "$("$python" scripts/sweep_rule.py finalists "$check")"
        # The path at the winners: the lam 0.8 rows are the weighted set-up's validated ones (lr-sweep/).
        rows=$("$python" scripts/sweep_rule.py rows "$check" "$experiment")
        [ "$setup" = unweighted ] || rows="double-clip,mgda[lr=0.3],$rows"
        # The rows' test runs already made (at the path's rates, or weighted-lr3/'s rate 3) are copied, not redone.
        sources="results/mnist-attributes-small/dr-path/$setup"
        [ "$setup" = unweighted ] || sources="$sources results/mnist-attributes-small/dr-path/weighted-lr3"
        path_at_own_rates "$experiment" "$rows" "results/mnist-attributes-small/dr-path/$setup-tuned" "$sources"
    done ;;
attributes-dr-path)
    rows="double-clip[lam=0.1],double-clip[lam=0.3],double-clip,double-clip[lam=3],double-clip[lam=100]"
    rows="$rows,mgda[lr=0.3],mgda[lam=100,lr=0.3]"
    done_seeds=""
    for seed in ${SEEDS:-0 1 2 3 4}; do
        done_seeds="$done_seeds${done_seeds:+,}$seed"
        for setup in weighted unweighted; do
            experiment=mnist-attributes
            [ "$setup" = weighted ] || experiment=mnist-attributes-unweighted
            "$drmoo" compare --experiment "$experiment" --preset small --seeds "$done_seeds" --jobs "$jobs" \
                --methods "$rows" --reference "double-clip[lam=100]" --device cpu --quiet \
                --out "results/mnist-attributes-small/dr-path/$setup" > /dev/null
        done
    done
    for setup in weighted unweighted; do
        "$python" scripts/dr_path.py "results/mnist-attributes-small/dr-path/$setup"
        "$python" scripts/multiple_comparisons.py "results/mnist-attributes-small/dr-path/$setup"
    done ;;
dr-path-rates)
    # Lam 0.8's rates are the 2-digit comparison's validated ones (../lr-sweep/): Double-Clip 1.0, MGDA 0.1.
    check=results/multimnist2-small/dr-path/lr-sweep
    grown_sweep multimnist2 "$check" "$(lam_rate_grid "${LAMS:-0.1 0.3 3 100}" "0.3 1.0 3.0" 100 "0.03 0.1 0.3")"
    sweep multimnist2 1,2 "$check/runoff" "$("$python" scripts/sweep_rule.py finalists "$check")"
    rows="double-clip,mgda,$("$python" scripts/sweep_rule.py rows "$check" multimnist2)"
    # The rows' test runs already made at the path's rates are copied, not redone.
    path_at_own_rates multimnist2 "$rows" results/multimnist2-small/dr-path-tuned results/multimnist2-small/dr-path \
        --eps "$eps" ;;
dr-path)
    out=results/multimnist2-small/dr-path
    "$drmoo" compare --experiment multimnist2 --preset small --seeds 0,1,2,3,4 --eps "$eps" --jobs "$jobs" \
        --methods "double-clip[lam=0.1],double-clip[lam=0.3],double-clip,double-clip[lam=3],double-clip[lam=100],mgda,mgda[lam=100]" \
        --reference "double-clip[lam=100]" \
        --device cpu --quiet --out "$out"
    "$python" scripts/dr_path.py "$out"
    "$python" scripts/multiple_comparisons.py "$out" ;;
sweep)
    # The grid, and one more point beyond an end where the best rate sat at that end (see SMALL_LR).
    # MoCo with the paper's ema (the small preset's own ema came later, from moco-sweep).
    spec="double-clip[lr=10.0],moco[ema=0.95,lr=0.03]"
    for method in double-clip double-loop mgda modo moco sdmgrad nashmtl famo; do
        for lr in 0.1 0.3 1.0 3.0; do
            if [ "$method" = moco ]; then spec="$spec,moco[ema=0.95,lr=$lr]"; else spec="$spec,$method[lr=$lr]"; fi
        done
    done
    sweep multimnist2 0 results/multimnist2-small/lr-sweep "$spec" ;;
sweep3)
    # The grid of the 2-digit sweep, and one more point beyond an end where the best rate sat at that end.
    spec="double-clip[lr=10.0]"
    for method in double-clip double-loop mgda modo moco sdmgrad nashmtl famo; do
        for lr in 0.1 0.3 1.0 3.0; do spec="$spec,$method[lr=$lr]"; done
    done
    sweep multimnist3 0 results/multimnist3-small/lr-sweep "$spec" ;;
runoff)
    # Each method's two best rates of the one-seed sweep (results/multimnist2-small/lr-sweep/table.csv).
    spec="double-clip[lr=3.0],double-clip[lr=1.0],double-loop[lr=0.3],double-loop[lr=0.1],mgda[lr=0.3]"
    spec="$spec,mgda[lr=0.1],modo[lr=0.3],modo[lr=0.1],sdmgrad[lr=0.3],sdmgrad[lr=0.1]"
    spec="$spec,nashmtl[lr=0.3],nashmtl[lr=0.1],famo[lr=0.3],famo[lr=0.1]"
    sweep multimnist2 1,2 results/multimnist2-small/lr-sweep/runoff "$spec" ;;
runoff3)
    # Each method's two best rates of the one-seed sweep (results/multimnist3-small/lr-sweep/table.csv).
    spec="double-clip[lr=3.0],double-clip[lr=1.0],double-loop[lr=0.3],double-loop[lr=0.1],mgda[lr=0.3]"
    spec="$spec,mgda[lr=0.1],modo[lr=0.3],modo[lr=0.1],moco[lr=0.3],moco[lr=1.0],sdmgrad[lr=0.3],sdmgrad[lr=1.0]"
    spec="$spec,nashmtl[lr=1.0],nashmtl[lr=0.3],famo[lr=1.0],famo[lr=0.3]"
    sweep multimnist3 1,2 results/multimnist3-small/lr-sweep/runoff "$spec" ;;
moco-sweep)
    "$drmoo" compare --experiment multimnist2 --preset small --eval-split validation --seeds 0,1,2 --eps 0 \
        --jobs "$jobs" --device cpu --quiet --out results/multimnist2-small/moco-sweep \
        --methods "moco[ema=0.95,lr=0.1],moco[ema=0.95,lr=0.3],moco[ema=0.9,lr=0.2],moco[ema=0.9,lr=0.3],moco[ema=0.9,lr=0.5],moco[ema=0.8,lr=0.2],moco[ema=0.8,lr=0.3],moco[ema=0.8,lr=0.5],moco[ema=0.8,lr=0.1],moco[ema=0.6,lr=0.1],moco[ema=0.6,lr=0.2],moco[ema=0.6,lr=0.3]" ;;
*)
    echo "usage: bash scripts/reproduce_small.sh [2|3|sweep|runoff|sweep3|runoff3|moco-sweep|ablations|ablations-replication|features|features-sweep|features-runoff|features-swept|k4|k9|k9-all|k4-sweep|k4-runoff|k4-swept|k9-sweep|k9-runoff|k9-swept|common-rate|controls|b64-sweep|b64-runoff|b64|attributes|attributes-key|attributes-sweep|attributes-runoff|dr-path|dr-path-rates|attributes-dr-path|attributes-dr-path-rates]" >&2
    exit 2 ;;
esac
echo "[reproduce_small $what] wall time $(( $(date +%s) - start )) s, $jobs jobs on $(nproc --all) cores"
