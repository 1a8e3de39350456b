# A misspelled instruction, a port that is no port, a deprecated
# instruction, lower-case instructions.
# expect: Unknown instruction: RUNN
# expect: Invalid containerPort: metrics
# expect: MAINTAINER has been deprecated
# expect: Instructions should be written in uppercase letters
FROM debian:12-slim AS runtime
MAINTAINER deltad
RUNN apt-get update
copy deploy/ /deploy/
EXPOSE metrics
ENTRYPOINT ["/usr/sbin/deltad"]
