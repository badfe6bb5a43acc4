//go:build !unix

package replyspin

import (
	"net"
	"time"
)

// poller reads a socket without parking; there is none on this platform.
type poller interface {
	poll(p []byte, budget time.Duration) (n int, err error, ok bool)
}

func newPoller(net.Conn) poller { return nil }
