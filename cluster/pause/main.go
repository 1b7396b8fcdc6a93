// pause holds a pod's namespaces open: it sleeps until SIGINT or SIGTERM and, as PID 1 of
// the pod, reaps the zombies of processes that share its PID namespace.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	children := make(chan os.Signal, 1)
	signal.Notify(children, syscall.SIGCHLD)
	for {
		select {
		case <-stop:
			os.Exit(0)
		case <-children:
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
