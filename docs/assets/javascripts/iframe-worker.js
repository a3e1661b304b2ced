/*
 * A stand-in for Web Workers on pages opened from the file system (file://), written for
 * accel's documentation site. Browsers refuse to start a worker from a file:// page, and
 * Material's search runs in a worker; with this, search works in site/index.html opened as a
 * file, with no server and no network. mkdocs.yml loads it through extra.polyfills (the file
 * name contains "iframe-worker", so Material's offline plugin does not add its CDN copy).
 *
 * Over http(s) it does nothing. On file:// it replaces window.Worker: the worker's script runs
 * in a hidden iframe of this page (same origin), whose global postMessage is routed back to the
 * worker object, and messages posted to the worker are dispatched in the iframe as "message"
 * events. Structured clones keep the two sides from sharing objects, as with a real worker.
 */
(function () {
  "use strict";
  if (location.protocol !== "file:" || typeof document === "undefined") {
    return;
  }

  class FileWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.onerror = null;
      this.pending = [];
      this.loaded = false;
      this.frame = document.createElement("iframe");
      this.frame.setAttribute("aria-hidden", "true");
      this.frame.tabIndex = -1;
      this.frame.style.display = "none";
      (document.body || document.documentElement).appendChild(this.frame);

      const scope = this.frame.contentWindow;
      scope.postMessage = (data) => this.receive(data);
      scope.importScripts = () => {
        throw new Error("importScripts is not available to a worker of a file:// page");
      };
      const script = scope.document.createElement("script");
      script.src = new URL(url, location.href).href;
      script.onload = () => {
        this.loaded = true;
        this.pending.splice(0).forEach((data) => this.deliver(data));
      };
      script.onerror = () => this.fail(new Error(`cannot load the worker script ${script.src}`));
      scope.addEventListener("error", (event) => this.fail(event.error || event));
      scope.document.head.appendChild(script);
    }

    postMessage(data) {
      if (this.loaded) {
        this.deliver(data);
      } else {
        this.pending.push(data);
      }
    }

    deliver(data) {
      const scope = this.frame.contentWindow;
      if (scope) {
        scope.dispatchEvent(new scope.MessageEvent("message", { data: structuredClone(data) }));
      }
    }

    receive(data) {
      const event = new MessageEvent("message", { data: structuredClone(data) });
      setTimeout(() => {
        if (typeof this.onmessage === "function") {
          this.onmessage(event);
        }
        this.dispatchEvent(event);
      });
    }

    fail(error) {
      const event = new ErrorEvent("error", { error, message: String(error) });
      if (typeof this.onerror === "function") {
        this.onerror(event);
      }
      this.dispatchEvent(event);
    }

    terminate() {
      this.frame.remove();
    }
  }

  window.Worker = FileWorker;
})();
