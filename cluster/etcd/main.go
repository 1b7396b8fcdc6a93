// Command etcd is the etcd server, built from its published module so that the
// control plane of `make cluster` needs nothing but the Go module proxy.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
