// goproxy: native peers for the gateway benchmark, to measure what moving the hot path
// out of Python would buy on the machine under test.
//
//	-mode http: Go's net/http/httputil.ReverseProxy, flushing every write (FlushInterval -1),
//	            a real HTTP/1.1 proxy: it parses each request and answer, pools upstream
//	            keep-alive connections and streams chunked answers as they come.
//	-mode tcp:  a bare TCP relay, io.Copy both ways per connection (no HTTP at all).
//
// Neither answers anything itself: GET /health goes through to the backend, which is how
// the benchmark sees them up. Standard library only (no module download).
//
//	goproxy -mode http -listen 127.0.0.1:9100 -backend 127.0.0.1:9001
package main

import (
	"flag"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"time"
)

func main() {
	mode := flag.String("mode", "http", "http (reverse proxy) or tcp (bare relay)")
	listen := flag.String("listen", "127.0.0.1:9100", "address to listen on")
	backend := flag.String("backend", "127.0.0.1:9001", "host:port of the backend")
	flag.Parse()
	switch *mode {
	case "http":
		target := &url.URL{Scheme: "http", Host: *backend}
		proxy := httputil.NewSingleHostReverseProxy(target)
		proxy.FlushInterval = -1
		proxy.Transport = &http.Transport{
			MaxIdleConns:        4096,
			MaxIdleConnsPerHost: 4096,
			IdleConnTimeout:     30 * time.Second,
			DisableCompression:  true,
		}
		srv := &http.Server{Addr: *listen, Handler: proxy}
		log.Fatal(srv.ListenAndServe())
	case "tcp":
		ln, err := net.Listen("tcp", *listen)
		if err != nil {
			log.Fatal(err)
		}
		for {
			down, err := ln.Accept()
			if err != nil {
				log.Fatal(err)
			}
			go relay(down, *backend)
		}
	default:
		log.Fatalf("-mode: http or tcp, not %q", *mode)
	}
}

func relay(down net.Conn, backend string) {
	up, err := net.Dial("tcp", backend)
	if err != nil {
		log.Printf("backend %s: %v", backend, err)
		down.Close()
		return
	}
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		io.Copy(dst, src)
		if tc, ok := dst.(*net.TCPConn); ok {
			tc.CloseWrite()
		}
		done <- struct{}{}
	}
	go pipe(up, down)
	go pipe(down, up)
	<-done
	<-done
	up.Close()
	down.Close()
}
