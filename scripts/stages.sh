# Stage clocks for the CI scripts (test.sh, build.sh, install_check.sh, .ci/run), sourced by them.
# `stage NAME` starts a stage and ends the one before; `stage_took NAME SECONDS CPU_SECONDS` notes one
# timed elsewhere (a stage that ran in the background). `stage_times TITLE` ends the last one and prints
# each: wall seconds, CPU seconds (user + system, of the processes the stage ran and waited for) and the
# 1-minute load average at its end. CI machines may be shared: wall times move with what else runs, CPU
# seconds much less; compare stages within one run. With OOMMAGIC_STAGE_TIMES=FILE the lines are also
# appended to FILE, where .ci/run collects every script's.
STAGE_NAME=""
STAGE_START=$SECONDS
STAGE_LINES=()

# CPU seconds of this shell's finished children: cutime + cstime of /proc/PID/stat, in clock ticks.
stage_cpu() {
  local f
  read -r -a f <"/proc/$$/stat"
  echo $(((f[15] + f[16]) / $(getconf CLK_TCK)))
}
STAGE_CPU=$(stage_cpu)

stage_took() {
  local line
  line="$(printf '%5ss  %5ss CPU  %-50s load %s' "$2" "$3" "$1" "$(cut -d' ' -f1 /proc/loadavg)")"
  STAGE_LINES+=("$line")
  if [ -n "${OOMMAGIC_STAGE_TIMES:-}" ]; then echo "$line" >>"$OOMMAGIC_STAGE_TIMES"; fi
}

stage() {
  local cpu
  cpu=$(stage_cpu)
  if [ -n "$STAGE_NAME" ]; then stage_took "$STAGE_NAME" $((SECONDS - STAGE_START)) $((cpu - STAGE_CPU)); fi
  STAGE_NAME="$1"
  STAGE_START=$SECONDS
  STAGE_CPU=$cpu
  if [ -n "$STAGE_NAME" ]; then echo "== $STAGE_NAME"; fi
}

stage_times() {
  stage ""
  echo "== stage times: $1"
  if [ "${#STAGE_LINES[@]}" -gt 0 ]; then printf '%s\n' "${STAGE_LINES[@]}"; fi
}
