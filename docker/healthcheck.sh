#!/bin/bash
# The image's HEALTHCHECK: GET /health from the server mla-serve runs in this container, at the
# address and port it was told on its own command line (else MLA_SERVE_HOST, else its defaults),
# so `docker run IMAGE --port 9000` is checked on 9000. /health answers 200 while requests are
# served and 503 once the engine has failed; while weights load the port accepts connections
# but answers nothing, and the 5 s read limit turns that into a failure, which the HEALTHCHECK's
# start period does not count. Plain bash (/dev/tcp) because the image has no curl.
set -u
host="${MLA_SERVE_HOST:-127.0.0.1}" port=8000
for cmdline in /proc/[0-9]*/cmdline; do
  mapfile -d '' -t argv < "$cmdline" 2> /dev/null || continue
  [[ "${argv[0]:-}" == *mla-serve ]] || continue
  for ((i = 1; i < ${#argv[@]}; i++)); do
    case "${argv[i]}" in
      --port) port="${argv[i + 1]:-}" ;;
      --port=*) port="${argv[i]#--port=}" ;;
      --host) host="${argv[i + 1]:-}" ;;
      --host=*) host="${argv[i]#--host=}" ;;
    esac
  done
  break
done
# A wildcard address listens on loopback too.
case "$host" in
  0.0.0.0) host=127.0.0.1 ;;
  :: | '[::]') host=::1 ;;
esac
exec 3<> "/dev/tcp/$host/$port" || exit 1
printf 'GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3
read -r -t 5 status <&3 || exit 1
[[ "$status" == HTTP/1.?" 200 "* ]]
