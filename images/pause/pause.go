// pause: the pod sandbox's process (containerd's sandbox_image). It holds the pod's namespaces
// open, reaps the zombies a shared PID namespace hands it, and exits on SIGINT or SIGTERM.
// Built static by scripts/build-image.sh pause (Debian's golang-go; no registry needed).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
