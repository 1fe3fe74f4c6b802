module hybridllm.dev/bench/goproxy

go 1.26
